"""--enable-weight-updates (entrypoints/openai/rl_routes.py): a trainer process broadcasts a
checkpoint over gloo to the served engine through SGLang's endpoints, the API key guards
them, /pause and /resume work over HTTP, and responses carry the weights' version tag."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.server.conftest import core_engine, running_server
from tests.unit.test_weight_sync import free_port, run_trainer
from vllm_rlt.engine.weight_sync import weight_specs
from vllm_rlt.engine_config import EngineConfig, ParallelConfig
from vllm_rlt.entrypoints.openai.settings import ServerSettings
from vllm_rlt.models.toy import toy_weights

KEY = {"Authorization": "Bearer rl-key"}
BODY = {"model": "toy", "prompt": "weights", "max_tokens": 4, "temperature": 0}


def test_a_trainer_updates_a_served_engine_over_http():
    new = list(toy_weights(2).items())
    names, dtypes, shapes = weight_specs(new)
    with running_server(in_process=True, enable_weight_updates=True, api_key="rl-key") as (
        url,
        state,
    ):
        assert httpx.post(f"{url}/pause").status_code == 401
        group = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
        refused = httpx.post(
            f"{url}/init_weights_update_group", json={**group, "rank_offset": 0}, headers=KEY
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "rank_offset"
        as_text = {**group, "master_port": str(group["master_port"]), "rank_offset": 1}
        refused = httpx.post(f"{url}/init_weights_update_group", json=as_text, headers=KEY)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "master_port"
        assert httpx.get(f"{url}/get_weight_version", headers=KEY).json() == {
            "weight_version": None
        }
        assert (
            "weight_version"
            not in httpx.post(f"{url}/v1/completions", json=BODY, headers=KEY).json()
        )
        trainer = multiprocessing.get_context("spawn").Process(
            target=run_trainer, args=(group["master_port"], [new])
        )
        with ThreadPoolExecutor(1) as pool:
            # the join waits for a trainer not yet started; the engine serves meanwhile
            joining = pool.submit(
                httpx.post,
                f"{url}/init_weights_update_group",
                json={**group, "rank_offset": 1, "backend": "gloo"},
                headers=KEY,
                timeout=120,
            )
            for _ in range(3):
                served = httpx.post(f"{url}/v1/completions", json=BODY, headers=KEY, timeout=30)
                assert served.status_code == 200 and not joining.done()
            trainer.start()
            joined = joining.result()
        try:
            assert joined.status_code == 200 and joined.json()["success"]
            assert (
                httpx.post(f"{url}/pause", params={"mode": "soon"}, headers=KEY).status_code == 400
            )
            paused = httpx.post(f"{url}/pause", params={"mode": "keep"}, headers=KEY)
            assert paused.json() == {"is_paused": True}
            assert httpx.get(f"{url}/is_paused", headers=KEY).json() == {"is_paused": True}
            updated = httpx.post(
                f"{url}/update_weights_from_distributed",
                json={"names": names, "dtypes": dtypes, "shapes": shapes, "weight_version": "v1"},
                headers=KEY,
                timeout=60,
            )
            assert updated.json() == {"success": True, "weight_version": "v1"}
        finally:
            trainer.join(60)
            if trainer.is_alive():
                trainer.kill()
        assert trainer.exitcode == 0
        model = core_engine(state).model
        for name, tensor in new[:4]:
            assert torch.equal(model.checkpoint_views()[name], tensor)
        assert httpx.post(f"{url}/resume", headers=KEY).json() == {"is_paused": False}
        answer = httpx.post(f"{url}/v1/completions", json=BODY, headers=KEY).json()
        assert answer["weight_version"] == "v1" and answer["choices"][0]["text"] is not None
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**BODY, "stream": True}, headers=KEY
        ) as stream:
            chunks = [line[6:] for line in stream.iter_lines() if line.startswith("data: {")]
        assert chunks and all(json.loads(chunk)["weight_version"] == "v1" for chunk in chunks)


def test_the_routes_need_the_flag_and_a_single_core():
    with running_server(in_process=True) as (url, _):
        assert httpx.post(f"{url}/pause").status_code == 404
        assert httpx.post(f"{url}/update_weights_from_disk", json={}).status_code == 404
    with pytest.raises(ValueError, match="--enable-weight-updates needs one engine core") as caught:
        ServerSettings(
            enable_weight_updates=True,
            engine_config=EngineConfig(parallel_config=ParallelConfig(data_parallel_size=2)),
        )
    assert caught.value.param == "enable_weight_updates"


def test_a_shutdown_answers_a_join_still_waiting_with_503():
    """At shutdown (after --shutdown-timeout, as for requests) a caller still waiting for
    a join of the trainer's group gets a 503 error object, not a cancelled request."""
    with running_server(in_process=True, enable_weight_updates=True) as (url, state):
        group = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(
                httpx.post,
                f"{url}/init_weights_update_group",
                json={**group, "rank_offset": 1},
                timeout=60,
            )
            served = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
            assert served.status_code == 200 and not joining.done()
            state.abort_all()  # what the server's shutdown does once its timeout has run
            left = joining.result()
        assert left.status_code == 503
        assert left.json()["error"]["message"] == "the server is shutting down: the join was left"


def test_a_lone_surrogate_in_a_weight_route_is_a_400_and_the_engine_serves_on():
    """The weight routes' bodies get the Unicode check every completion body gets: a lone
    surrogate in weight_version reached the core, whose message encoding killed it (every
    later request answered 503), and one in master_address raised a 500 from the store."""
    folder = "vllm_rlt/assets/ouro-tasks"
    bodies = {
        "update_weights_from_disk": b'{"model_path": "%s", "weight_version": "\\ud800"}'
        % folder.encode(),
        "init_weights_update_group": b'{"master_address": "\\udfff", "master_port": 29500, '
        b'"world_size": 2, "rank_offset": 1}',
    }
    with running_server(in_process=True, enable_weight_updates=True) as (url, _):
        for route, raw in bodies.items():
            reply = httpx.post(
                f"{url}/{route}", content=raw, headers={"Content-Type": "application/json"}
            )
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] in ("weight_version", "master_address")
            assert "lone surrogate" in error["message"]
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 200
