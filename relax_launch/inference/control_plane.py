"""ControlPlane: rank 0's inference side of the job — one ``InferenceManager`` per role, the
gateway thread (the door for external clients), the controller's in-process ``EngineClients``
and, in route mode ``router``, the sglang-router process in front of rollout.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_launch.inference.config import GatewayConfig, InferenceRoleConfig, RoutingPolicy
from relax_launch.inference.disaggregation import EngineHalf, PrefillTarget, check_pair
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import MEMORY_TAGS, EngineHandle
from relax_launch.inference.gateway import InferenceGateway
from relax_launch.inference.generation_routes import Renderer
from relax_launch.inference.inprocess import EngineClients
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.model_config import ServedModel
from relax_launch.inference.router import SGLangRouter
from relax_launch.inference.router_workers import RouterWorkers
from relax_launch.inference.serve import GatewayServer

log = logging.getLogger("relax_launch.gateway")


@dataclass(frozen=True)
class ModelSpec:
    """A further model of a role (``{role}.models``): its config section (``model_sections``),
    directory, and the role's engines (by index) that serve it."""

    section: InferenceRoleConfig
    model_dir: Path
    engines: tuple[int, ...]

    @property
    def model_id(self) -> str:
        return self.section.resolved_model_id(self.section.model)


@dataclass(frozen=True)
class RoleSpec:
    """One inference role as the control plane sees it."""

    role: str
    model: str  # the reference from the config (builtin:NAME or a directory)
    model_dir: Path
    section: InferenceRoleConfig
    phase: str
    parked: bool = False  # its engines start with every memory tag released
    more: tuple[ModelSpec, ...] = ()  # its further models; the other engines serve the default

    def model_of_engine(self, index: int) -> str:
        """The id of the model the role's engine ``index`` serves."""
        chosen = (m.model_id for m in self.more if index in m.engines)
        return next(chosen, self.section.resolved_model_id(self.model))


def _served(model_dir: Path) -> ServedModel:
    """The model in ``model_dir`` as its manager serves it: a vision-language model's
    vocabulary is its text model's."""
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    image_token = config.get("image_token_id") if "vision_config" in config else None
    return ServedModel(str(model_dir), vocab, image_token)


def routing_spec(spec: RoleSpec, policy: RoutingPolicy) -> RoutingSpec:
    """Every model's names: its id, its aliases and its model reference (an alias only while
    no other model of the role shares it), and its route keys."""
    models = [(spec.section.resolved_model_id(spec.model), spec.section)]
    models += [(m.model_id, m.section) for m in spec.more]
    references = [section.model or spec.model for _, section in models]
    aliases, route_keys = {}, {}
    for (model_id, section), reference in zip(models, references, strict=True):
        shared = references.count(reference) > 1
        names = (*((reference,) if not shared else ()), *section.aliases)
        aliases |= {name: model_id for name in names}
        route_keys |= {key: model_id for key in section.route_keys}
    ids = {model_id for model_id, _ in models}
    return RoutingSpec(
        default_model=models[0][0],
        aliases={name: m for name, m in aliases.items() if name not in ids},
        route_key_map=route_keys,
        policy=policy,
    )


def build_manager(
    spec: RoleSpec, gateway: GatewayConfig, timeout_s: float, restart_wait_s: float = 0.0
) -> InferenceManager:
    served = _served(spec.model_dir)
    manager = InferenceManager(
        role=spec.role,
        model_id=spec.section.resolved_model_id(spec.model),
        served_model_name=str(spec.model_dir),  # what SGLang reports as the model's name
        weight_source=WeightSource.TRAINER if spec.role == "rollout" else WeightSource.STATIC,
        routing=routing_spec(spec, gateway.routing_policy),
        phase=spec.phase,
        drain_timeout_s=timeout_s,
        vocab_size=served.vocab_size,
        fault_tolerant=getattr(spec.section, "fault_tolerance", False),
        restart_wait_s=restart_wait_s,
        elastic=spec.section.max_engines is not None,
    )
    manager.models[manager.model_id] = served  # whether it takes images, too
    for more in spec.more:  # its further models, each on engines of its own
        manager.models[more.model_id] = _served(more.model_dir)
    return manager


def judge_renderers(roles: list[RoleSpec]) -> dict[str, Renderer]:
    """The genrm role's judge form, rendered with each model's own chat template: by role
    (its default model) and by ``role/model_id`` (``generation_routes.renderer_for``)."""
    renderers = {}
    for spec in roles:
        if spec.role == "genrm":
            renderers[spec.role] = chat_renderer(spec.model_dir)
            renderers |= {f"genrm/{m.model_id}": chat_renderer(m.model_dir) for m in spec.more}
    return renderers


def chat_renderer(model_dir: Path) -> Renderer:
    """Judge messages -> prompt with the model's own chat template (tokenizer loaded once).

    Messages ending with an assistant message are a prefilled reply: the prompt ends inside it
    and the engine continues it (``"Score:"`` makes a small judge answer with a number).
    """
    loaded: list[Any] = []
    lock = threading.Lock()

    def render(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        with lock:
            if not loaded:
                from transformers import AutoTokenizer  # only when the judge form is used

                loaded.append(AutoTokenizer.from_pretrained(str(model_dir)))
        prefilled = messages[-1].get("role") == "assistant"
        return loaded[0].apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=not prefilled,
            continue_final_message=prefilled,
            **kwargs,
        )

    return render


def pair_up(handles: list[EngineHandle], halves: Sequence[EngineHalf], timeout_s: float) -> None:
    """Mark each engine's half (a prefill engine with the bootstrap port its server reports,
    a decode engine with its prefill engine), then have every pair generate a token."""
    for handle, half in zip(handles, halves, strict=False):
        handle.half = half.half
        if half.half == "prefill":
            info = handle.info("/server_info")
            handle.bootstrap_port = int(info["disaggregation_bootstrap_port"])
        if half.prefill_index is not None:
            handle.prefill_id = handles[half.prefill_index].engine_id
    by_id = {h.engine_id: h for h in handles}
    for handle in handles:
        if handle.prefill_id is not None:
            prefill = by_id[handle.prefill_id]
            target = PrefillTarget.at(prefill.engine_id, prefill.url, prefill.bootstrap_port)
            check_pair(handle.url, target, timeout_s)


class ControlPlane:
    """Managers, gateway, engine clients and router of one job; ``close`` stops what it
    started. The RL controller reaches the engines through ``engines``, not the gateway."""

    def __init__(
        self,
        roles: list[RoleSpec],
        *,
        gateway: GatewayConfig,
        admin_token: str | None,
        log_dir: Path,
        operation_timeout_s: float = 120.0,
        request_timeout_s: float | None = None,
        restart_wait_s: float = 0.0,
    ) -> None:
        self.specs = {spec.role: spec for spec in roles}
        self.config, self.log_dir = gateway, log_dir
        # one engine request's bound (the job sizes auto by its batch), gateway and controller
        self.request_timeout_s = (
            gateway.timeout_s() if request_timeout_s is None else request_timeout_s
        )
        self.managers = {
            s.role: build_manager(s, gateway, operation_timeout_s, restart_wait_s) for s in roles
        }
        renderers = judge_renderers(roles)
        app = InferenceGateway(
            self.managers,
            config=gateway,
            admin_token=admin_token,
            renderers=renderers,
            run_dir=log_dir,
            request_timeout_s=self.request_timeout_s,
        )
        self.server = GatewayServer(app, gateway.host, gateway.port)
        # the controller's requests are counted beside the gateway's, on its /metrics
        self.engines = EngineClients(
            self.managers,
            timeout_s=self.request_timeout_s,
            renderers=renderers,
            registry=app.metrics.registry,
            images=app.generation.images,
        )
        self.router: SGLangRouter | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve the gateway (alive, nothing ready yet), record where it listens, and start the
        controller's engine clients."""
        self.server.start(timeout_s)
        self.engines.start()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        record = {"url": self.url, "roles": sorted(self.managers)}
        (self.log_dir / "gateway.json").write_text(json.dumps(record) + "\n")
        log.info("gateway serving on %s (roles: %s)", self.url, record["roles"])

    def attach(
        self,
        role: str,
        urls: list[str],
        startup_timeout_s: float,
        halves: Sequence[EngineHalf] = (),
    ) -> None:
        """A role's engines are up: hand them to its manager (and the router, if used).

        ``halves``, for a disaggregated role, says of each engine (by index) which half it is
        and, for a decode engine, the index of its prefill engine; each pair generates a token
        before the role is attached."""
        manager, spec = self.managers[role], self.specs[role]
        loaded = set() if spec.parked else set(MEMORY_TAGS)
        handles = [
            EngineHandle(
                f"{spec.model_of_engine(i)}/{i}",
                url,
                role=role,
                static=role != "rollout",
                index=i,
                loaded=set(loaded),
                model_id=spec.model_of_engine(i),
            )
            for i, url in enumerate(urls)
        ]
        pair_up(handles, halves, startup_timeout_s)
        router_url, workers = None, None
        if role == "rollout" and self.config.rollout_route_mode == "router":
            self.router = SGLangRouter(
                worker_urls=[h.url for h in handles if h.half is None],
                prefill=[(h.url, h.bootstrap_port) for h in handles if h.half == "prefill"],
                decode_urls=[h.url for h in handles if h.half == "decode"],
                log_path=self.log_dir / "router.log",
                policy=self.config.routing_policy,
            )
            self.router.start(startup_timeout_s)
            router_url = self.router.url
            if all(h.half is None for h in handles):  # its workers follow routing from now on
                workers = RouterWorkers(router_url, self.router.worker_urls)
        manager.attach(handles, router_url=router_url, router=workers)

    def coordinated_by(self, leases: Callable[[], dict[str, dict[str, Any]]]) -> None:
        """split/defer: show each role's lease on its admin engines route, and refuse admin
        drain/offload/onload (the coordinator alone moves memory)."""
        self.server.app.admin.leases = leases

    def scaled_by(self, scaler: Any) -> None:
        """Elastic roles: the scale routes, the admin engines route and discovery's spare pool
        go to rank 0's ``EngineScaler`` (``runtime/scaling.py``)."""
        self.server.app.scaling.scaler = scaler
        self.server.app.admin.scaling = scaler.scaling
        self.server.app.pool = scaler.pool

    def close(self) -> None:
        """Stop routing, keep the final metrics (``gateway_metrics.txt``: the gateway's and the
        controller's requests), stop what we started."""
        self.engines.close()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "gateway_metrics.txt").write_bytes(self.server.app.metrics.render())
        for manager in self.managers.values():
            manager.shutdown()
        if self.router is not None:
            self.router.stop()
        self.server.stop()
