"""The advantage: group-relative advantages and Phi, the difficulty anchor C_t and its
state, and the per-prompt history (docs/math.md, sections 2-4)."""
