"""The loss types (``grpo``, ``dapo``, ...) as presets: each a row of :data:`LOSS_PRESETS`
that fixes an objective and its ratio form, the aggregation, the std normalisation and
the clip range, which ``LossConfig.build`` resolves and any option overrides."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LossPreset:
    """What a loss type means: the objective and its ratio form, the aggregation, the std
    normalisation and the clip range (docs/math.md, section 5b), and the objective's
    options where the host sets them otherwise than the objective's defaults."""

    normalize_std: bool
    loss_agg_mode: str
    clip_range: tuple[float, float]
    objective: str = "clip"
    ratio_level: str = "token"
    options: dict = field(default_factory=dict)

    @property
    def sequence_level(self) -> bool:
        return self.ratio_level != "token"


# TRL's loss types under their names (TRL 1.16's defaults), GSPO with the seed's ranges,
# and verl's policy losses that TRL lacks (verl's sapo and gspo are TRL's; verl's cispo is
# cispo_clip: see docs/options.md for the host names).
LOSS_PRESETS = {
    "grpo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-mean", clip_range=(0.2, 0.2)),
    # TRL's bnpo: token-mean over the call (dapo's count is the whole batch's: a normaliser).
    "bnpo": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2)),
    # DAPO's decoupled clip (docs/math.md, section 5).
    "dapo": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.28)),
    # GSPO's sequence-level ranges from the seed's Table 8.
    "gspo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-mean", clip_range=(3e-4, 4e-4),
                       ratio_level="gspo_token"),
    "dr_grpo": LossPreset(normalize_std=False, loss_agg_mode="seq-mean-token-sum-norm", clip_range=(0.2, 0.2)),
    "cispo": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="cispo_cap"),
    "sapo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-mean", clip_range=(0.2, 0.2),
                       objective="sapo"),
    # LUSPO: GSPO's sequence ratio, each response's loss weighed by its length.
    "luspo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-sum", clip_range=(0.2, 0.2),
                        ratio_level="sequence"),
    "vespo": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="vespo",
                        ratio_level="sequence"),
    # GMPO: TRL's experimental default log-space range.
    "gmpo": LossPreset(normalize_std=True, loss_agg_mode="seq-mean-token-mean", clip_range=(0.4, 0.4),
                       objective="gmpo", ratio_level="sequence"),
    "gpg": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="gpg"),
    # verl's other policy losses, with the ranges verl's actor defaults to; dro's beta has no
    # default (verl requires one), its preset takes 0.1.
    "dppo_tv": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="dppo_tv"),
    "dppo_kl": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="dppo_kl"),
    "dro": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="dro",
                      options={"dro_beta": 0.1}),
    "clip_cov": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2),
                           objective="clip_cov"),
    "kl_cov": LossPreset(normalize_std=True, loss_agg_mode="token-mean", clip_range=(0.2, 0.2), objective="kl_cov"),
}
LOSS_TYPES = tuple(LOSS_PRESETS)
