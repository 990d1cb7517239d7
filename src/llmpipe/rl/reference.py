"""GRPO's synced reference model in its checkpoints (``grpo.sync_ref_model``).

TRL's GRPOTrainer moves its reference toward the policy every `ref_model_sync_steps` optimizer steps
(`trl.trainer.callbacks.SyncRefModelCallback`: each weight becomes ``alpha * policy + (1 - alpha) * reference``;
TR-DPO, Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment"), but the Trainer's
checkpoints hold the policy only: a resumed run would rebuild the reference from models/<policy> and lose every
sync before the interruption. :func:`checkpoint_reference` makes each checkpoint carry the reference too, written
before the Trainer's ``trainer_state.json`` (a checkpoint counts as whole only once that file is there), and loads
it back wherever the Trainer loads a checkpoint's weights.
"""

from __future__ import annotations

from pathlib import Path

from llmpipe.core.errors import UserError

REFERENCE_FILE = "reference.safetensors"
"""The reference's weights inside ``checkpoint-<step>/``."""


def checkpoint_reference(trainer) -> None:
    """Make `trainer`'s checkpoints save and restore its `ref_model`.

    The Trainer saves a checkpoint's weights with ``save_model(folder, _internal_call=True)`` first and loads them
    with ``_load_from_checkpoint(folder)`` (resume, and llmpipe's finished-run path): both are wrapped, as
    `llmpipe.train.callbacks.BatchLedger` wraps ``training_step``.

    Args:
        trainer: A TRL `GRPOTrainer` with a reference model (``beta`` > 0, no peft adapter: params validation
            refuses sync otherwise; a sharded strategy too, whose reference this does not gather).
    """
    from safetensors.torch import load_model, save_model

    save_weights, load_weights = trainer.save_model, trainer._load_from_checkpoint

    def reference():
        return trainer.accelerator.unwrap_model(trainer.ref_model)

    def save_with_reference(output_dir: str | None = None, _internal_call: bool = False) -> None:
        save_weights(output_dir, _internal_call)
        if output_dir is not None and trainer.args.should_save:
            save_model(reference(), str(Path(output_dir) / REFERENCE_FILE))  # handles tied embeddings

    def load_with_reference(checkpoint: str, model=None) -> None:
        load_weights(checkpoint, model)
        path = Path(checkpoint) / REFERENCE_FILE
        if not path.is_file():
            raise UserError(
                f"{checkpoint} has no {REFERENCE_FILE}: grpo.sync_ref_model moves the reference during training, "
                "and this checkpoint did not save it (written by other llmpipe code?); resume another checkpoint or "
                "start over with --restart"
            )
        missing, unexpected = load_model(reference(), str(path))
        if missing or unexpected:
            raise UserError(f"{path} does not fit the reference model (missing {missing}, unexpected {unexpected})")

    trainer.save_model = save_with_reference
    trainer._load_from_checkpoint = load_with_reference
