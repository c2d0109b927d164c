"""Show a PlacementPlan: a text table of the rank map, and a picture (SVG or PNG) of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relax_launch.placement.memory_plan import GB, DevicePhase, Holder, MemoryPlan
from relax_launch.placement.plan import PlacementPlan, RankPlan, RoleAssignment, shared_tp_size

ROLE_COLOURS = {
    "trainer": "#4C72B0",
    "critic": "#DD8452",
    "rollout": "#55A868",
    "teacher": "#C44E52",
    "genrm": "#8172B2",
}
MAX_PICTURE_RANKS = 256
_CELL_W, _CELL_H, _LABEL_W, _TOP, _GAP = 76, 40, 96, 48, 6


def describe(assignment: RoleAssignment, half: str | None = None) -> str:
    """One role of one rank, e.g. ``rollout[e1 head]``, ``rollout[e2 head prefill]`` (``half``
    of a disaggregated role) or ``trainer[tp0 pp0 dp1]``."""
    a = assignment
    if a.role == "trainer":
        cp = f" cp{a.cp_rank}" if a.cp_rank is not None else ""
        ep = f" ep{a.ep_rank}" if a.ep_rank is not None else ""
        return f"trainer[tp{a.tp_rank}{cp} pp{a.pp_rank} dp{a.dp_rank}{ep}]"
    if a.role == "critic":  # the value model on ranks of its own
        return f"critic[tp{a.tp_rank} dp{a.dp_rank}]"
    place = "head" if a.is_head else f"follower{a.engine_rank}"
    return f"{a.role}[e{a.engine_index} {place}{f' {half}' if half else ''}]"


def half_of(plan: PlacementPlan, a: RoleAssignment) -> str | None:
    """ "prefill"/"decode" for a rank of a disaggregated role's engine, "reserved" for one of
    the engines a scale-out starts (max_engines), "models[K]" for one of a further model of
    its role, else None."""
    if a.engine_index is None:
        return None
    engine = plan.engines_of(a.role)[a.engine_index]
    if engine.model:
        return f"models[{engine.model - 1}]"
    if engine.pool:
        return "pool"
    return "reserved" if engine.reserved else engine.disaggregation


def roles_label(plan: PlacementPlan, rank: RankPlan) -> str:
    """Every role of one rank, e.g. ``trainer[tp0 pp0 dp0], rollout[e0 head]``, or ``idle``."""
    return ", ".join(describe(a, half_of(plan, a)) for a in rank.assignments) or "idle"


def table(plan: PlacementPlan) -> str:
    """The rank map as aligned text, followed by the plan's ``summary``."""
    rows = [("rank", "node", "local", "roles", "phase")]
    for r in plan.ranks:
        roles = roles_label(plan, r)
        phases = ", ".join(dict.fromkeys(a.phase for a in r.assignments)) or "-"
        rows.append((str(r.rank), str(r.node), str(r.local_rank), roles, phases))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([*lines, "", summary(plan)])


def summary(plan: PlacementPlan) -> str:
    """Mode and world, the trainer grid, each engine, the phase order and weight-sync groups."""
    t = plan.trainer
    lines = [
        f"mode: {plan.mode}   world: {plan.nnodes} node(s) x {plan.nproc_per_node} = "
        f"{plan.world_size} ranks   plan hash: {plan.stable_hash()}",
        f"trainer: ranks {t.ranks[0]}-{t.ranks[-1]}  tp={t.tp_size} pp={t.pp_size} dp={t.dp_size}"
        + (f" cp={t.cp_size}" if t.cp_size > 1 else "")
        + (f" ep={t.ep_size}" if t.ep_size > 1 else ""),
        *expert_layout(plan),
    ]
    if plan.critic is not None:
        c = plan.critic
        lines.append(
            f"critic: ranks {c.ranks[0]}-{c.ranks[-1]}  tp={c.tp_size} dp={c.dp_size} (its own)"
        )
    for e in plan.engines:
        prefill = plan.prefill_of(e)
        pair = f" <- prefill engine {prefill.index}" if prefill is not None else ""
        lines.append(
            f"{e.label}: ranks {e.ranks[0]}-{e.ranks[-1]} (head {e.head_rank}) "
            f"tp={e.tp_size} pp={e.pp_size} node(s) {','.join(map(str, e.nodes))}{pair}"
        )
    pool = [e for e in plan.engines if e.pool]
    if pool:
        ranks = sorted({r for e in pool for r in e.ranks})
        lines.append(
            f"spare pool: ranks {_span(tuple(ranks))}, for no role; on scale-out "
            + ", ".join(f"{e.role} engine {e.index}" for e in pool)
            + " (whichever holds its ranks first)"
        )
    lines.append("phase order: " + " -> ".join(plan.phase_order))
    rollout = [e for e in plan.engines_of("rollout") if not e.reserved]
    tp_size = shared_tp_size(rollout)
    for g in plan.weight_sync_groups:
        ep = f" ep{g.ep_rank}" if t.ep_size > 1 else ""
        by_tp_rank = (tp_size or 1) > 1 and plan.mode not in ("split", "defer")  # no buckets
        groups = f" in each of {tp_size} groups by engine TP rank" if by_tp_rank else ""
        whole = " (engines of different TP sizes: whole tensors)" if tp_size is None else ""
        lines.append(
            f"weight sync pp{g.pp_rank}{ep}: source rank {g.source_rank} -> "
            f"{g.world_size - 1} rollout worker(s){groups} in {len(g.engine_rank_offsets)} "
            f"engine(s){whole}"
        )
    return "\n".join(lines)


def expert_layout(plan: PlacementPlan) -> list[str]:
    """Which trainer ranks hold which experts of every MoE layer (none for a dense model)."""
    t = plan.trainer
    if not t.num_experts:
        return []
    per_rank = t.num_experts // t.ep_size
    lines = [f"experts: {t.num_experts} per MoE layer, {per_rank} per EP rank"]
    for ep in range(t.ep_size):
        ranks = [r for r in t.ranks if t.ep_rank(r) == ep]
        lines.append(
            f"  ep{ep}: experts {ep * per_rank}-{(ep + 1) * per_rank - 1} on "
            + f"rank{'s' * (len(ranks) > 1)} {','.join(map(str, ranks))}"
        )
    return lines


@dataclass(frozen=True)
class _Box:
    x: int
    y: int
    w: int
    h: int
    fill: str
    text: str
    text_fill: str = "#ffffff"


def _boxes(plan: PlacementPlan) -> tuple[int, int, list[_Box]]:
    """Geometry shared by the SVG and PNG writers: one row per phase, one column per rank."""
    if plan.world_size > MAX_PICTURE_RANKS:
        raise ValueError(
            f"a picture draws at most {MAX_PICTURE_RANKS} ranks; this plan has "
            f"{plan.world_size}: use the table or --json instead"
        )
    boxes = []
    for col, rank in enumerate(plan.ranks):
        x = _LABEL_W + col * _CELL_W + rank.node * _GAP
        boxes.append(
            _Box(x, 8, _CELL_W - 4, 32, "#ffffff", f"r{rank.rank} n{rank.node}", "#000000")
        )
    for row, phase in enumerate(plan.phase_order):
        y = _TOP + row * (_CELL_H + 4)
        boxes.append(_Box(0, y, _LABEL_W - 8, _CELL_H, "#ffffff", phase, "#000000"))
        for col, rank in enumerate(plan.ranks):
            x = _LABEL_W + col * _CELL_W + rank.node * _GAP
            here = [a for a in rank.assignments if a.phase == phase]
            a = here[0] if here else None
            fill = ROLE_COLOURS[a.role] if a else "#eeeeee"
            label = "" if a is None else a.role
            if a is not None and a.engine_index is not None:
                half = half_of(plan, a)
                label += f" e{a.engine_index}{f' {half[0].upper()}' if half else ''}"
            boxes.append(_Box(x, y, _CELL_W - 4, _CELL_H, fill, label))
    width = _LABEL_W + len(plan.ranks) * _CELL_W + plan.nnodes * _GAP
    height = _TOP + len(plan.phase_order) * (_CELL_H + 4) + 4
    return width, height, boxes


def write_picture(plan: PlacementPlan, path: str | Path) -> Path:
    """Draw ranks as boxes coloured by role, one row per phase, to ``.svg`` or ``.png``."""
    path = Path(path)
    width, height, boxes = _boxes(plan)
    if path.suffix == ".svg":
        path.write_text(_svg(width, height, boxes))
    elif path.suffix == ".png":
        _png(width, height, boxes, path)
    else:
        raise ValueError(f"picture file {path} must end in .svg or .png")
    return path


def _svg(width: int, height: int, boxes: list[_Box]) -> str:
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    for b in boxes:
        parts.append(
            f'<rect x="{b.x}" y="{b.y}" width="{b.w}" height="{b.h}" rx="4" fill="{b.fill}" '
            'stroke="#333333" stroke-width="0.5"/>'
            f'<text x="{b.x + b.w // 2}" y="{b.y + b.h // 2 + 4}" text-anchor="middle" '
            f'fill="{b.text_fill}">{b.text}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def _png(width: int, height: int, boxes: list[_Box], path: Path) -> None:
    from PIL import Image, ImageDraw, ImageFont  # only needed for PNG output

    image = Image.new("RGB", (width, height), "#ffffff")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=12)
    for b in boxes:
        draw.rounded_rectangle(
            (b.x, b.y, b.x + b.w, b.y + b.h), radius=4, fill=b.fill, outline="#333333"
        )
        draw.text(
            (b.x + b.w // 2, b.y + b.h // 2), b.text, fill=b.text_fill, anchor="mm", font=font
        )
    image.save(path)


def memory_table(memory: MemoryPlan) -> str:
    """Each device's phases: its total, what is left, and every role's terms in GB. Devices
    whose phases hold the same are one row group (``ranks 0-3``)."""
    groups: dict[tuple, list[DevicePhase]] = {}
    for device in memory.devices:
        key = (device.phase, tuple(_holder_text(h) for h in device.holders))
        groups.setdefault(key, []).append(device)
    by_ranks: dict[tuple[int, ...], list[tuple]] = {}
    for key, devices in groups.items():
        by_ranks.setdefault(tuple(d.rank for d in devices), []).append((key, devices[0]))
    cap = memory.capacity / GB
    lines = [f"memory per device: {cap:.1f} GB ({memory.capacity_source}); GB by phase:"]
    for ranks, phases in sorted(by_ranks.items()):
        lines.append(f"  ranks {_span(ranks)}")
        for (phase, holders), device in phases:
            free = max(cap - device.total / GB, 0.0)  # SGLang's default fills its device
            lines.append(
                f"    {phase:<10} {device.total / GB:6.1f} (free {free:5.1f})  "
                + " | ".join(holders)
            )
    for engine in memory.engines:
        f = "" if engine.fraction is None else f" mem_fraction_static {engine.fraction:.3f}"
        source, tokens = engine.fraction_source, engine.kv_tokens
        lines.append(f"  {engine.label}:{f} ({source}), KV {tokens} tokens")
    return "\n".join([*lines, *(f"  note: {n}" for n in memory.notes)])


def _holder_text(holder: Holder) -> str:
    terms = ", ".join(
        f"{t.name} {t.bytes / GB:.2f}{' (host)' if t.host else ''}" for t in holder.terms
    )
    role = holder.role.split(" engine")[0]
    return f"{role} [{holder.state}]" + (f": {terms}" if terms else "")  # offloaded: nothing


def _span(ranks: tuple[int, ...]) -> str:
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
