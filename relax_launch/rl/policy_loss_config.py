"""The choice of policy loss and its settings: fields of the ``algorithm`` section
(``AlgorithmConfig`` inherits them), each refused where it would not act. The losses themselves
are ``trainer/surrogates.py``'s."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relax_launch.config.section import Section

# Losses whose own weight is the trainer-over-engine importance ratio: a rollout correction on
# top would weight the tokens twice, so ``auto`` resolves to none for them.
OWN_CORRECTION = ("cispo", "m2po")


class PolicyLossFields(Section):
    """The policy loss (PPO-clip, CISPO, SAPO or M2PO) and its settings."""

    policy_loss: Literal["ppo", "cispo", "sapo", "m2po"] = Field(
        "ppo",
        description="ppo: PPO-clip (clip_eps, clip_eps_high). cispo: CISPO (MiniMax-M1, "
        "arXiv:2506.13585), REINFORCE weighted by the importance ratio capped at 1 + "
        "cispo_clip_high, without gradient, so every token keeps its gradient. sapo: SAPO "
        "(arXiv:2511.20347), a smooth gate of the ratio (sapo_tau_pos, sapo_tau_neg) instead "
        "of the hard clip. m2po: M2PO (arXiv:2510.01161) for stale samples, the ratio to the "
        "sampling engine unclipped, masking the tokens of largest squared log-ratio until "
        "their second moment is within m2po_threshold.",
    )
    cispo_clip_high: float = Field(
        0.2,
        gt=0,
        description="policy_loss cispo: the importance weight is capped at 1 + this (no lower "
        "bound, as the paper).",
    )
    sapo_tau_pos: float = Field(
        1.0,
        gt=0,
        description="policy_loss sapo: the gate's temperature on tokens with a positive "
        "advantage (larger: the gate closes faster as the ratio leaves 1).",
    )
    sapo_tau_neg: float = Field(
        1.05,
        gt=0,
        description="policy_loss sapo: the gate's temperature on the other tokens (the paper "
        "keeps it above sapo_tau_pos: negative updates are the less stable ones).",
    )
    m2po_threshold: float = Field(
        0.04,
        gt=0,
        description="policy_loss m2po: the bound on the mean squared log importance ratio "
        "(trainer over engine) of the tokens kept, per micro-batch, so of the batch too "
        "(the paper's 0.04).",
    )

    @model_validator(mode="after")
    def _policy_loss_knobs_act(self) -> PolicyLossFields:
        """A setting of another loss than the chosen one, or a combination the chosen loss
        already covers, is refused."""
        loss, chosen = self.policy_loss, self.model_fields_set
        owners = {
            "cispo_clip_high": "cispo",
            "sapo_tau_pos": "sapo",
            "sapo_tau_neg": "sapo",
            "m2po_threshold": "m2po",
            "clip_eps": "ppo",
            "clip_eps_high": "ppo",
        }
        for knob, owner in owners.items():
            if knob in chosen and loss != owner:
                raise ValueError(
                    f"algorithm.{knob} acts only with algorithm.policy_loss={owner} (it is "
                    f"{loss}): remove algorithm.{knob} or choose that loss"
                )
        ratio = getattr(self, "policy_ratio", "token")
        if ratio == "sequence" and loss in ("cispo", "m2po"):
            raise ValueError(
                f"algorithm.policy_ratio=sequence is GSPO's sequence ratio; policy_loss={loss} "
                "weighs each token by its own ratio: set policy_ratio=token or choose ppo or sapo"
            )
        correction = getattr(self, "rollout_correction", "auto")
        if loss in OWN_CORRECTION and correction not in ("auto", "none"):
            raise ValueError(
                f"algorithm.policy_loss={loss} already weighs each token by its trainer-over-"
                f"engine ratio ({'capped' if loss == 'cispo' else 'masked by its second moment'})"
                f"; algorithm.rollout_correction={correction} would weigh it twice: set it to "
                "auto or none"
            )
        return self
