"""The gateway's scale routes over a real gateway: the admin token first, then the body's types
(422), then what rank 0's scaler refuses passes through with its status (400, 409); an
accepted request answers 202 with where its progress is; an unknown id is 404. The scaler here
answers in process; the real one runs in tests/rl/test_elastic_job.py."""

from __future__ import annotations

import httpx
from conftest import ADMIN_TOKEN, make_manager, serve

from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.gateway import InferenceGateway
from relax_launch.inference.scale_routes import ScaleRefused

AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


class Operation:
    def __init__(self, request_id: str, kind: str, target: int) -> None:
        self.request_id, self.role, self.kind, self.target = request_id, "genrm", kind, target

    def document(self, actual: int) -> dict:
        return {"request_id": self.request_id, "operation": self.kind, "actual": actual}


class Scaler:
    """Accepts scale_out to 2 once; refuses the rest as the real scaler would."""

    def __init__(self) -> None:
        self.ops: dict[str, Operation] = {}

    def request(self, role, kind, target, *, model, timeout_s):
        if target > 2:
            raise ScaleRefused(400, "num_replicas=3 is outside 1 (the planned engines) to 2")
        if self.ops:
            raise ScaleRefused(409, "scale_out to 2 engines of genrm is in flight")
        op = Operation("abc123", kind, target)
        self.ops[op.request_id] = op
        return op

    def get(self, role, kind, request_id):
        op = self.ops.get(request_id)
        return op if op is not None and op.kind == kind else None

    def listed(self, role, kind):
        return [op for op in self.ops.values() if op.kind == kind]

    def cancel(self, role, request_id):
        if request_id not in self.ops:
            raise ScaleRefused(404, f"genrm has no scale_out operation {request_id!r}")
        raise ScaleRefused(409, f"scale_out {request_id} already ended: succeeded")

    def actual(self, role: str) -> int:
        return 1

    def scaling(self, role: str) -> dict:
        return {"replicas": [{"index": 1, "state": "starting"}], "operation": None}


def elastic_genrm():
    manager = make_manager("genrm", ["http://127.0.0.1:9"])
    manager.elastic = True
    return {"genrm": manager}


def post(url: str, path: str, body: object, auth: dict | None = AUTH) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=auth or {}, timeout=10)


def error(reply: httpx.Response) -> str:
    return reply.json()["error"]["message"]


def test_scale_routes_answer_each_status():
    with serve(elastic_genrm(), scaler=Scaler()) as url:
        assert post(url, "/genrm/scale_out", {"num_replicas": 2}, auth=None).status_code == 401
        for wrong in ({"num_replicas": "2"}, {"num_replicas": 2, "extra": 1}, {}):
            reply = post(url, "/genrm/scale_out", wrong)
            assert reply.status_code == 422 and error(reply), (wrong, reply.text)
        reply = post(url, "/genrm/scale_out", {"num_replicas": 3})
        assert reply.status_code == 400 and "outside 1 (the planned engines)" in error(reply)
        reply = post(url, "/genrm/scale_out", {"num_replicas": 2, "timeout_secs": 30})
        assert reply.status_code == 202 and reply.json()["request_id"] == "abc123"
        assert reply.headers["location"] == "/genrm/scale_out/abc123"
        reply = post(url, "/genrm/scale_in", {"num_replicas": 1})
        assert reply.status_code == 409 and "in flight" in error(reply)
        status = httpx.get(url + "/genrm/scale_out/abc123", headers=AUTH)
        assert status.status_code == 200 and status.json()["actual"] == 1
        assert httpx.get(url + "/genrm/scale_in/abc123", headers=AUTH).status_code == 404
        assert httpx.get(url + "/genrm/scale_out/nope", headers=AUTH).status_code == 404
        assert httpx.get(url + "/genrm/scale_out/abc123").status_code == 401
        engines = httpx.get(url + "/genrm/admin/engines", headers=AUTH).json()
        assert engines["replicas"] == [{"index": 1, "state": "starting"}]
        listed = httpx.get(url + "/genrm/scale_out", headers=AUTH)
        assert listed.status_code == 200 and [
            o["request_id"] for o in listed.json()["operations"]
        ] == ["abc123"]
        assert httpx.get(url + "/genrm/scale_in", headers=AUTH).json()["operations"] == []
        assert httpx.get(url + "/genrm/scale_out").status_code == 401
        assert post(url, "/genrm/scale_out/abc123/cancel", None, auth=None).status_code == 401
        reply = post(url, "/genrm/scale_out/abc123/cancel", None)
        assert reply.status_code == 409 and "already ended" in error(reply)
        assert post(url, "/genrm/scale_out/nope/cancel", None).status_code == 404
        assert post(url, "/genrm/scale_in/abc123/cancel", None).status_code in (404, 405)
        paths = httpx.get(url + "/openapi.json").json()["paths"]
        wanted = {"/genrm/scale_out", "/genrm/scale_in/{request_id}"}
        assert wanted | {"/genrm/scale_out/{request_id}/cancel"} <= set(paths)


def test_before_the_session_the_routes_are_409_and_a_static_role_has_none():
    with serve(elastic_genrm()) as url:
        reply = post(url, "/genrm/scale_out", {"num_replicas": 2})
        assert reply.status_code == 409 and "still starting" in error(reply)
    manager = make_manager("teacher", ["http://127.0.0.1:9"])
    app = InferenceGateway({"teacher": manager}, config=GatewayConfig(), admin_token=ADMIN_TOKEN)
    assert not [r for r in app.app.routes if "scale" in getattr(r, "path", "")]
