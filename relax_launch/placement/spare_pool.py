"""The shared spare pool (``cluster.spare_ranks``): ranks after every role's, reserved for no
role. Each elastic role (``max_engines``) gets reserved engines of its own shape laid over the
pool's ranks instead of ranks of its own: the same rank is a reserved rollout engine and a
reserved genrm engine, and whichever role scales out first holds it (``EngineScaler`` refuses
the other while it does). ``max_engines`` caps the role's engines; the pool caps them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_launch.config.errors import ConfigError
from relax_launch.placement.plan import EnginePlan
from relax_launch.placement.spans import check_engine_span

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig

ROLE_ORDER = ("rollout", "genrm", "teacher")  # the planner's slice order


def pool_roles(job: JobConfig) -> list[str]:
    """The roles that may start engines on the pool: those with ``max_engines``."""
    if not job.cluster.spare_ranks:
        return []
    roles = job.inference_roles()
    return [n for n in ROLE_ORDER if n in roles and roles[n].reserved_engines]


def pooled_ranks(job: JobConfig, role: str) -> int:
    """Ranks ``role`` would reserve for ``max_engines`` that the pool holds instead."""
    section = job.inference_roles()[role]
    if role not in pool_roles(job):
        return 0
    return section.reserved_engines * section.ranks_per_engine


def pool_engines(job: JobConfig, role: str) -> int:
    """Reserved engines of ``role`` on the pool: max_engines' beyond the planned ones, as many
    as the pool's ranks hold."""
    section = job.inference_roles()[role]
    return min(section.reserved_engines, job.cluster.spare_ranks // section.ranks_per_engine)


def check_pool(job: JobConfig) -> None:
    """The pool's config errors: no role to use it (max_engines, itself decoupled only and
    never beside prefill engines), an engine wider than it, an autoscaler without it or beside
    a role's own."""
    cluster = job.cluster
    if cluster.spare_autoscale is not None and not cluster.spare_ranks:
        raise ConfigError(
            "cluster.spare_autoscale moves the spare pool's ranks, but cluster.spare_ranks is 0: "
            "set spare_ranks, or remove spare_autoscale.",
            ("cluster.spare_autoscale", "cluster.spare_ranks"),
        )
    if not cluster.spare_ranks:
        return
    roles = pool_roles(job)
    if not roles:
        raise ConfigError(
            f"cluster.spare_ranks={cluster.spare_ranks} but no role may start engines there: "
            "set max_engines above a role's planned engines (rollout, teacher or genrm).",
            ("cluster.spare_ranks",),
        )
    sections = job.inference_roles()
    for role in roles:
        width = sections[role].ranks_per_engine
        if width > cluster.spare_ranks:
            raise ConfigError(
                f"a {role} engine spans {width} ranks ({role}.tp_size x {role}.pp_size), more "
                f"than cluster.spare_ranks={cluster.spare_ranks}: raise spare_ranks to at least "
                f"{width}, or remove {role}.max_engines.",
                ("cluster.spare_ranks", f"{role}.max_engines"),
            )
        if cluster.spare_autoscale is not None and sections[role].autoscale is not None:
            raise ConfigError(
                f"cluster.spare_autoscale scales {role} on the pool, and {role}.autoscale would "
                f"scale it too: remove {role}.autoscale.",
                (f"{role}.autoscale", "cluster.spare_autoscale"),
            )


def place_pool(
    engines: list[EnginePlan], job: JobConfig, first: int, per_node: int, phase: str
) -> None:
    """Each pool role's reserved engines on the pool's ranks (from ``first``), each from the
    pool's first rank on, so the roles' engines overlap; each where the planner's rule lets an
    engine lie (in one node, or whole nodes for one wider than a node)."""
    sections = job.inference_roles()
    for role in pool_roles(job):
        section, width = sections[role], sections[role].ranks_per_engine
        for k in range(pool_engines(job, role)):
            ranks = tuple(range(first + k * width, first + (k + 1) * width))
            index = sum(e.role == role for e in engines)
            check_engine_span(role, index, ranks[0], width, per_node, pool=True)
            engines.append(
                EnginePlan(
                    role=role,
                    index=index,
                    ranks=ranks,
                    tp_size=section.tp_size,
                    pp_size=section.pp_size,
                    phase=phase,
                    nodes=tuple(sorted({r // per_node for r in ranks})),
                    reserved=True,
                    pool=True,
                )
            )
