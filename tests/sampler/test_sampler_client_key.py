"""The SamplerClient presents its endpoint's key (the router's data-plane key, or an engine's --api-key):
the trainer's only way through a job's closed API (trainer/entrypoint.py reads RLFLEET_API_KEY). Against the
real reference server with --api-key on 127.0.0.1."""

from __future__ import annotations

import pytest
from test_sampler_server import engine

from rlfleet.retries import ClientRetryPolicy
from rlfleet.sampler.client import SamplerClient, TurnFailed
from rlfleet.sampler.http_app import start_reference_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
KEY = "job-key-0123456789"
SAMPLING = {"temperature": 0.0, "max_new_tokens": 3}


async def test_the_client_with_the_key_generates_and_without_it_fails_with_401() -> None:
    async with await start_reference_server(engine(), api_key=KEY) as server:
        async with SamplerClient(server.url, api_key=KEY) as client:
            turn = await client.generate([1, 2, 3], SAMPLING)
            assert len(turn.output_ids) == 3
            assert (await client.get_json("/model_info"))["weight_version"] == "0"
        for key in (None, "wrong"):
            async with SamplerClient(server.url, api_key=key, policy=ClientRetryPolicy()) as client:
                with pytest.raises(TurnFailed) as info:
                    await client.generate([1, 2, 3], SAMPLING)
                assert (info.value.reason, info.value.status, info.value.attempts) == ("http_401", 401, 1)
