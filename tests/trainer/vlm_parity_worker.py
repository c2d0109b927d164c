"""torchrun worker (TP = the world size): the trainer's Qwen2.5-VL against transformers' on
image+text and text-only sequences (fp32, CPU), and its weights gathered back to HF names.

argv: model_dir. Prints one JSON line on rank 0: {"logprob_diff": largest |trainer -
transformers| logprob, "tokens": tokens compared, "image_tokens": image placeholders among them,
"round_trip_mismatches": HF tensors not bit-equal after HF -> trainer -> HF, "tensors": count,
"vision_grad_diff": largest |trainer - transformers| vision tower gradient relative to the
weight's largest, "vision_grad_tp_spread":
largest difference between the TP ranks' vision tower gradients}.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

from relax_launch import platform
from relax_launch.models.vlm_processor import VisionProcessor
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.hf_dir import read_weights


def picture(size: tuple[int, int], shapes: list[tuple[str, str]]) -> Image.Image:
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for i, (kind, colour) in enumerate(shapes):
        box = (4 + 20 * i, 6, 22 + 20 * i, 24 + 3 * i)
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=colour)
    return image


def prompts(processor: VisionProcessor) -> list:
    """Two images of different grids in one chat (the second after text, so its positions
    start past the first's), one image alone, and text alone."""
    two = [
        {"type": "image"},
        {"type": "text", "text": "How many red circles? And here:"},
        {"type": "image"},
    ]
    chats = [
        (
            two,
            [picture((84, 56), [("circle", "red")] * 3), picture((56, 112), [("square", "blue")])],
        ),
        (
            [{"type": "image"}, {"type": "text", "text": "Count the shapes."}],
            [picture((56, 56), [])],
        ),
        ([{"type": "text", "text": "The capital of France is Paris."}], []),
    ]
    rows = []
    for content, images in chats:
        messages = [{"role": "user", "content": content}]
        prompt = processor.encode_chat(messages, images)
        reply = processor.tokenizer("The answer is 3.<|im_end|>")["input_ids"]
        prompt.ids = prompt.ids + reply
        rows.append(prompt)
    return rows


def transformers_logprobs(model_dir: str, row) -> torch.Tensor:
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([row.ids])
    kwargs = {}
    if row.pixel_values is not None:
        kwargs = {
            "pixel_values": row.pixel_values,
            "image_grid_thw": row.image_grid_thw,
            "mm_token_type_ids": (ids == model.config.image_token_id).int(),
        }
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, **kwargs).logits.float().log_softmax(-1)[0, :-1]
    return logits.gather(-1, ids[0, 1:, None])[:, 0]


def trainer_logprobs(module, row) -> torch.Tensor:
    from relax_launch.trainer.vlm_model import mrope_positions

    ids = torch.tensor([row.ids])
    grids = row.image_grid_thw if row.image_grid_thw is not None else torch.zeros(0, 3)
    positions = mrope_positions(ids[0], grids, module.shape)[:, None]
    with torch.no_grad():
        losses = module.eval()(
            ids[:, :-1],
            positions[:, :, :-1],
            labels=ids[:, 1:],
            pixel_values=row.pixel_values,
            image_grid_thw=row.image_grid_thw,
        )
    return -losses[0]


def vision_grads(module, model_dir: str, row, pgc) -> tuple[float, float]:
    """(largest |trainer - transformers| gradient of a vision tower weight relative to that
    weight's largest transformers gradient, largest difference
    between the TP ranks' vision gradients) of the summed logprobs of ``row``, from the logits:
    Megatron 0.16.1's fused cross entropy (the trainer's loss with labels) rounds the logits'
    gradient to bf16 whatever the dtype (``fusions/fused_cross_entropy.py::calculate_gradients``),
    which alone moves every gradient by up to 1.5e-3 of its largest."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from relax_launch.trainer.attention import gather_sequence
    from relax_launch.trainer.vlm_model import mrope_positions

    ids = torch.tensor([row.ids])
    positions = mrope_positions(ids[0], row.image_grid_thw, module.shape)[:, None]
    module.zero_grad()
    logits = module.train()(  # this TP rank's vocabulary slice; gathered, each rank's loss is whole
        ids[:, :-1],
        positions[:, :, :-1],
        pixel_values=row.pixel_values,
        image_grid_thw=row.image_grid_thw,
    )
    logits = gather_sequence(logits, pgc.tp, dim=2)  # its backward sums the ranks' gradients
    nll = -logits.log_softmax(-1).gather(-1, ids[:, 1:, None])
    (nll.sum() / pgc.tp.size()).backward()
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    logits = model.train()(
        input_ids=ids,
        pixel_values=row.pixel_values,
        image_grid_thw=row.image_grid_thw,
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
    ).logits[0, :-1]
    (-logits.log_softmax(-1).gather(-1, ids[0, 1:, None])).sum().backward()
    theirs = {n.removeprefix("model.visual."): p.grad for n, p in model.named_parameters()}
    ours = {n.removeprefix("vision."): p.grad for n, p in module.vision.named_parameters()}
    diff = max(float((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max()) for n in ours)
    flat = torch.cat([ours[n].flatten() for n in sorted(ours)])
    parts = [torch.empty_like(flat) for _ in range(pgc.tp.size())]
    dist.all_gather(parts, flat, group=pgc.tp)
    spread = max(float((part - parts[0]).abs().max()) for part in parts)
    return diff, spread


def round_trip(module, model_dir: str, pgc) -> tuple[int, int]:
    """(mismatching, all) HF tensors after gathering the module's shards back to HF names."""
    from relax_launch.trainer.vlm_conversion import (
        checkpoint_names,
        vlm_megatron_to_hf,
        vlm_tp_split_dim,
    )

    original = checkpoint_names(read_weights(Path(model_dir)))
    back = {}
    for name, param in module.named_parameters():
        local, dim = param.detach().contiguous(), vlm_tp_split_dim(name)
        if dim is not None and pgc.tp.size() > 1:
            parts = [torch.empty_like(local) for _ in range(pgc.tp.size())]
            dist.all_gather(parts, local, group=pgc.tp)
            local = torch.cat(parts, dim=dim)
        back |= dict(vlm_megatron_to_hf(name, local, module.shape, tp_size=pgc.tp.size()))
    names = set(original) | set(back)
    bad = [
        n
        for n in names
        if n not in back or n not in original or not torch.equal(back[n], original[n])
    ]
    return len(bad), len(names)


def tp_world_groups():
    """Join the process group and build the trainer's groups with every rank in one TP group
    (TP = the world size), Megatron prepared for the CPU: the VLM workers' common start."""
    dist.init_process_group(platform.dist_backend("cpu"))
    world = dist.get_world_size()
    layout = TrainerLayout(
        ranks=tuple(range(world)), tp_size=world, pp_size=1, dp_size=1, phase="train"
    )
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    return pgc


def main() -> None:
    pgc = tp_world_groups()
    world = pgc.tp.size()
    from relax_launch.trainer.vlm_model import build_vlm_module, load_vlm_checkpoint, read_vl_shape

    model_dir = sys.argv[1]
    section = TrainerConfig(model=model_dir, ranks=world, tp_size=world, dtype="float32")
    module = build_vlm_module(read_vl_shape(Path(model_dir)), section, pgc, "cpu")
    load_vlm_checkpoint(module, Path(model_dir), pgc)
    diff, tokens, image_tokens = 0.0, 0, 0
    for row in prompts(VisionProcessor(model_dir)):
        ours, theirs = trainer_logprobs(module, row), transformers_logprobs(model_dir, row)
        diff = max(diff, float((ours - theirs).abs().max()))
        tokens += len(ours)
        image_tokens += row.ids.count(module.shape.image_token_id)
    mismatches, tensors = round_trip(module, model_dir, pgc)
    grad_diff, grad_spread = vision_grads(
        module, model_dir, prompts(VisionProcessor(model_dir))[0], pgc
    )
    if dist.get_rank() == 0:
        report = {"logprob_diff": diff, "tokens": tokens, "image_tokens": image_tokens}
        report |= {"vision_grad_diff": grad_diff, "vision_grad_tp_spread": grad_spread}
        report |= {"round_trip_mismatches": mismatches, "tensors": tensors}
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
