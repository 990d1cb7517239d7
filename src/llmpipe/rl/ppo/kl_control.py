"""The coefficient of PPO's KL-to-reference penalty, fixed or adapted to a target KL (``ppo.kl_ctrl``).

Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", section 2.2, and the
`AdaptiveKLController` / `FixedKLController` of their lm-human-preferences code, which TRL's PPOTrainer carried
(as ``adap_kl_ctrl``, ``init_kl_coef``, ``target``, ``horizon``) until it moved to a fixed ``kl_coef``. The
adaptive rule is a proportional controller on the log of the coefficient::

    e = clip(KL / target - 1, -0.2, 0.2)
    beta <- beta * (1 + e * n / horizon)

with KL the mean over the step's responses of their summed per-token KL (nats per response) and ``n`` the
responses of the step, so `horizon` counts responses: the error closes by about 1/e over `horizon` of them.
Pure Python floats: the state is one number, written into every checkpoint as JSON.
"""

from __future__ import annotations

from typing import Literal

ERROR_CLIP = 0.2
"""The proportional error's bound (Ziegler et al. 2019): one step moves the coefficient by at most
``ERROR_CLIP * n / horizon`` of itself."""


class KLController:
    """The KL coefficient `value` and its update after each rollout.

    Args:
        kind: ``fixed`` (`value` never changes) or ``adaptive`` (Ziegler et al.'s rule above).
        kl_coef: The initial coefficient (TRL's ``init_kl_coef``).
        target: The KL the adaptive rule steers to, nats per response (TRL's ``target``).
        horizon: Responses over which it closes the error (TRL's ``horizon``).
    """

    def __init__(self, kind: Literal["fixed", "adaptive"], kl_coef: float, target: float, horizon: float) -> None:
        self.kind, self.value, self.target, self.horizon = kind, float(kl_coef), target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt the coefficient to the KL just measured (``adaptive``; ``fixed`` keeps it); returns the new value.

        Args:
            current_kl: Mean summed KL per response of the rollout the coefficient was just used on (nats).
            n_steps: Responses in that rollout.
        """
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1.0, -ERROR_CLIP), ERROR_CLIP)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """``{"value"}``, JSON-serialisable (a Python float round-trips exactly through JSON)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.value = float(state["value"])
