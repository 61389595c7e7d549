"""Every SGLang answer in tests/sampler/fixtures is what SGLang 0.5.23's own code assembles
(sglang_fixtures.py): rebuilt here, byte for byte."""

from __future__ import annotations

import pytest
import sglang_fixtures as fx


@pytest.mark.parametrize("name", sorted(fx.BUILDERS))
def test_fixture_is_what_sglang_assembles(name: str) -> None:
    on_disk = (fx.FIXTURES / name).read_text()
    assert on_disk == fx.render(fx.BUILDERS[name]()), (
        f"{name} is not what SGLang assembles: `.venv/bin/python tests/sglang_contract/sglang_fixtures.py`"
    )


def test_no_fixture_without_an_sglang_cross_check() -> None:
    files = {p.name for p in fx.FIXTURES.glob("*.json")}
    assert files - fx.NOT_OURS == set(fx.BUILDERS)
