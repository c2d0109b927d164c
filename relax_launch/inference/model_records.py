"""Discovery's record of one logical engine, from the manager's handles."""

from __future__ import annotations

from relax_launch.inference.discovery import EngineRecord, PrefillRecord, State
from relax_launch.inference.engine import EngineHandle


def engine_record(
    engine: EngineHandle, state: State, serving: dict[str, EngineHandle]
) -> EngineRecord:
    """One logical engine; a decode engine with its prefill half, which must be serving
    and whole too (a pair with a dead half is not routable)."""
    halves = [engine]
    prefill = None
    if engine.prefill_id is not None:
        partner = serving.get(engine.prefill_id)
        if partner is None:
            state = State.FAILED
        else:
            halves.append(partner)
            prefill = PrefillRecord(
                engine_id=partner.engine_id,
                base_url=partner.url,
                bootstrap_port=partner.bootstrap_port,
            )
    if state is State.READY and not all(h.complete for h in halves):
        state = State.ONLOADING
    return EngineRecord(
        engine_id=engine.engine_id,
        base_url=engine.url,
        state=state,
        direct_eligible=True,
        generation=engine.generation,
        prefill=prefill,
    )
