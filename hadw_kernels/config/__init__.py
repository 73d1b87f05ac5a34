"""A call's options: ``LossConfig`` (the resolved options every implementation receives),
the loss types' presets, the generated option types and the call's one config."""
