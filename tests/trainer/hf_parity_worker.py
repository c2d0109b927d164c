"""torchrun worker (one rank): the trainer's Megatron-core model against the Hugging Face model
it was converted from, on the same token sequences (fp32, CPU).

argv: model_dir... Prints one JSON line: {model_dir: largest |trainer - transformers| logprob}.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig

# Long enough that llama3 RoPE scaling (which changes only low frequencies) shows in logprobs.
SEQUENCES = [[(7 * i + 3) % 300 + 10 for i in range(200)], [5, 17, 42, 99, 7, 150, 23, 61]]


def transformers_logprobs(model_dir: str) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for tokens in SEQUENCES:
            ids = torch.tensor([tokens])
            logits = model(ids).logits.float().log_softmax(-1)[0, :-1]
            rows.append(logits.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return rows


def main() -> None:
    dist.init_process_group(platform.dist_backend("cpu"))
    layout = TrainerLayout(ranks=(0,), tp_size=1, pp_size=1, dp_size=1, phase="train")
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    from relax_launch.trainer.trainer import Trainer

    report = {}
    for model_dir in sys.argv[1:]:
        section = TrainerConfig(model=model_dir, ranks=1, dtype="float32", micro_batch_size=1)
        trainer = Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")
        ours = trainer.logprobs(TokenBatch.next_token(SEQUENCES, [1, 1]))
        theirs = transformers_logprobs(model_dir)
        report[model_dir] = max(
            float((torch.tensor(a) - torch.tensor(b)).abs().max())
            for a, b in zip(ours, theirs, strict=True)
        )
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
