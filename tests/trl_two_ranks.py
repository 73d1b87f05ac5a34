"""Two TRL runs on two CPU ranks (torchrun), stock GRPOTrainer and then the drop-in in a
layout, for tests/test_integration_trl_layouts.py: writes each run's parameters and TRL's
logged steps to OUT (one launch: the two ranks' start-up is most of a run's time).

    python -m torch.distributed.run --nproc_per_node 2 tests/trl_two_ranks.py MODEL_DIR OUT LAYOUT [zero2|zero3]
"""

import sys
from pathlib import Path

import torch

# Run by torchrun as a file: its folder (trl_runs) and the checkout (the trainer, which runs
# from its checkout and is not installed with the library) on the path.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_runs import PROMPTS, RUN, TOKENIZER, logged_steps, sevens  # noqa: E402

from hadw_kernels.integrations.trl import HADWGRPOConfig, HADWGRPOTrainer  # noqa: E402


def _gathered(model):
    """The whole parameters on every rank (under ZeRO-3 each holds a partition)."""
    from contextlib import nullcontext

    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def train(model_dir: str, output_dir: Path, layout: str | None, zero_stage: int | None) -> dict:
    """One run: stock TRL (``layout`` None) or the drop-in; rank 0's result."""
    options = dict(RUN, output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2, loss_type="dapo")
    if zero_stage is not None:
        # Every parameter partitioned, however small (DeepSpeed keeps those under 1e5 elements whole by default).
        zero = {"stage": zero_stage, "stage3_param_persistence_threshold": 0}
        options["deepspeed"] = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto", "zero_allow_untested_optimizer": True}
    if layout is None:
        trainer = GRPOTrainer(model=model_dir, reward_funcs=sevens, train_dataset=PROMPTS, processing_class=TOKENIZER,
                              args=GRPOConfig(**options))
    else:
        trainer = HADWGRPOTrainer(model=model_dir, reward_funcs=sevens, train_dataset=PROMPTS,
                                  processing_class=TOKENIZER,
                                  args=HADWGRPOConfig(**options, use_hadw=False, hadw_layout=layout))
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    with _gathered(model):
        parameters = {name: tensor.detach().clone() for name, tensor in model.named_parameters()}
    return {"parameters": parameters, "steps": logged_steps(trainer),
            "layout": getattr(trainer, "layout", None) and trainer.layout.name}


def main() -> None:
    model_dir, out, layout = sys.argv[1:4]
    zero_stage = int(sys.argv[4].removeprefix("zero")) if len(sys.argv) > 4 else None
    runs = {name: train(model_dir, Path(out).parent / f"trl-{name}", None if name == "stock" else layout, zero_stage)
            for name in ("stock", "drop-in")}
    if torch.distributed.get_rank() == 0:
        torch.save(runs, out)


if __name__ == "__main__":
    main()
