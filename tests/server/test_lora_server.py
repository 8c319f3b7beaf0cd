"""LoRA adapters through the server and across the engine-process boundary: requests choose an adapter
by `model`, /v1/models lists the base and its adapters, /v1/load_lora_adapter and
/v1/unload_lora_adapter (admin key) change them at run time, bad adapters get a 400 naming the
reason while the server goes on serving, and the adapter a request names reaches a core in its own
process. Every output is compared with mlx-lm's own generation with the adapter loaded."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from lora_utils import ADAPTER_SPECS, References, fresh, make_adapter
from server_utils import MODEL, Served, ServeProcess, engine_config, error_of
from utils import make_tokenizer

from pagedmlx.engine.async_engine import AsyncEngine
from pagedmlx.config import EngineConfig
from pagedmlx.engine.core_client import CoreProcess
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.lora.request import LoRARequest
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.server.serving_models import LoRAModulePath, ServingModels

ADMIN = "admin-key"
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7]]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    out = {f"a{i}": make_adapter(str(root / f"a{i}"), fresh(), **spec) for i, spec in enumerate(ADAPTER_SPECS[:3])}
    out["too-big"] = make_adapter(str(root / "too-big"), fresh(), rank=16, scale=1.0, seed=9, keys=["self_attn.q_proj"])
    return out


@pytest.fixture(scope="module")
def refs():
    return References(fresh())


def _served(paths, admin_key=ADMIN, **kw) -> Served:
    engine = LLMEngine(fresh()(), make_tokenizer(512), engine_config(enable_lora=True, max_loras=2, max_lora_rank=8,
                                                                     **kw))
    async_engine = AsyncEngine(engine)
    models = ServingModels(async_engine, MODEL, async_engine.max_model_len, [LoRAModulePath("a0", paths["a0"])])
    asyncio.run(models.init_static_loras())
    return Served(engine, admin_key=admin_key, models=models, async_engine=async_engine)


def _complete(url: str, model: str, prompt: list[int], stream: bool = False) -> tuple[int, dict]:
    body = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True, return_token_ids=True,
                stream=stream)
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    if stream and r.status_code == 200:
        import json

        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return 200, {"model": chunks[0]["model"], "tokens": [t for c in chunks for t in c["choices"][0]["token_ids"]]}
    data = r.json()
    return r.status_code, ({"model": data["model"], "tokens": data["choices"][0]["token_ids"]}
                           if r.status_code == 200 else error_of(r))


def test_requests_choose_adapters_by_model_and_adapters_load_and_unload_at_run_time(paths, refs):
    served = _served(paths)
    url, admin = served.url, {"Authorization": f"Bearer {ADMIN}"}
    try:
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("a0", MODEL)]
        assert models[1]["root"] == paths["a0"]
        for model, path in [("a0", paths["a0"]), (MODEL, None)]:
            for stream in (False, True):
                status, got = _complete(url, model, PROMPTS[0], stream)
                assert status == 200 and got == {"model": model, "tokens": refs(path, PROMPTS[0], 8)}, (model, stream)
        status, err = _complete(url, "a1", PROMPTS[0])
        assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"

        load = url + "/v1/load_lora_adapter"
        assert httpx.post(load, json={"lora_name": "a1", "lora_path": paths["a1"]}).status_code == 401
        r = httpx.post(load, json={"lora_name": "a1", "lora_path": paths["a1"]}, headers=admin)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' added successfully."
        bad = [({"lora_name": "big", "lora_path": paths["too-big"]}, 400, "rank 16 exceeds max_lora_rank 8"),
               ({"lora_name": "gone", "lora_path": paths["a0"] + "-missing"}, 404, "No adapter found"),
               ({"lora_name": "a1", "lora_path": paths["a2"]}, 400, "has already been loaded"),
               ({"lora_name": ""}, 400, "lora_name: String should have at least 1 character")]
        for body, status, reason in bad:
            r = httpx.post(load, json=body, headers=admin)
            assert r.status_code == status and reason in error_of(r)["message"], (body, r.text)
        r = httpx.post(load, json={"lora_name": "a2", "lora_path": paths["a2"]}, headers=admin)
        assert r.status_code == 200
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [MODEL, "a0", "a1", "a2"]

        async def three_adapters_at_once():  # two slots: one of them waits its turn
            async with httpx.AsyncClient(timeout=30) as client:
                async def one(model, prompt):
                    r = await client.post(url + "/v1/completions", json=dict(
                        model=model, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True,
                        return_token_ids=True))
                    return r.json()["choices"][0]["token_ids"]
                return await asyncio.gather(*(one(m, p) for m, p in zip(["a0", "a1", "a2"], PROMPTS)))

        got = asyncio.run(three_adapters_at_once())
        assert got == [refs(paths[f"a{i}"], p, 8) for i, p in enumerate(PROMPTS)]

        unload = url + "/v1/unload_lora_adapter"
        r = httpx.post(unload, json={"lora_name": "a1"}, headers=admin)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' removed successfully."
        assert _complete(url, "a1", PROMPTS[0])[0] == 404
        r = httpx.post(unload, json={"lora_name": "a1"}, headers=admin)
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"
        status, got = _complete(url, "a2", PROMPTS[1])  # still serving
        assert status == 200 and got["tokens"] == refs(paths["a2"], PROMPTS[1], 8)
    finally:
        served.stop()


def test_without_an_admin_key_nobody_loads_adapters_and_without_lora_nothing_is_routed(paths):
    served = _served(paths, admin_key=None)
    try:
        r = httpx.post(served.url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": paths["a1"]})
        assert r.status_code == 403 and "--admin-key" in error_of(r)["message"]
    finally:
        served.stop()
    plain = Served(LLMEngine(fresh()(), make_tokenizer(512), engine_config()), admin_key=ADMIN)
    try:
        r = httpx.post(plain.url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": paths["a1"]},
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 404
        assert [m["id"] for m in httpx.get(plain.url + "/v1/models").json()["data"]] == [MODEL]
    finally:
        plain.stop()


def test_an_engine_core_process_runs_the_adapter_each_request_names(paths, refs):
    config = EngineConfig(model="random:llama-tiny", block_size=8, num_blocks=128, max_model_len=256,
                          enable_lora=True, max_loras=2, max_lora_rank=8)
    ae = AsyncEngine(CoreProcess(config))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, paths[f"a{i}"]) for i in range(3)] + [None]

    async def main():
        async def one(i, prompt, lora):
            return [o async for o in ae.generate(prompt, params, f"r{i}", lora_request=lora)][-1]
        outs = await asyncio.gather(*(one(i, PROMPTS[i % 3], lora) for i, lora in enumerate(loras)))
        with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank 8"):
            await ae.add_request("bad", PROMPTS[0], params, lora_request=LoRARequest("big", 9, paths["too-big"]))
        assert await ae.list_loras() == {1, 2, 3}
        assert await ae.remove_lora(2) and await ae.list_loras() == {1, 3}
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        ae.shutdown(timeout=0)
    for i, (out, lora) in enumerate(zip(outs, loras)):
        want = refs(lora.lora_path if lora else None, PROMPTS[i % 3], 8)
        assert out.outputs[0].token_ids == want and out.lora_request == lora, lora


def test_serve_takes_lora_modules_and_refuses_a_bad_one(paths, refs):
    common = ["--model", "random:llama-tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    server = ServeProcess(*common, "--lora-modules", f"a0={paths['a0']}", "--admin-key", ADMIN)
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [MODEL, "a0"]
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": paths["a1"]},
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200
        for model, path in [("a0", paths["a0"]), ("a1", paths["a1"]), (MODEL, None)]:
            status, got = _complete(server.url, model, PROMPTS[2])
            assert status == 200 and got["tokens"] == refs(path, PROMPTS[2], 8), model
    finally:
        server.kill()
    with pytest.raises(AssertionError, match="rank 16 exceeds max_lora_rank 8"):
        ServeProcess(*common, "--lora-modules", f"big={paths['too-big']}")
