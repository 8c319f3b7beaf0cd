"""EngineConfig's compilation_config (vLLM's name): the kernel switches as one JSON object, from Python and the CLI."""

from __future__ import annotations

import pytest

from pagedmlx.cli import engine_config, make_parser
from pagedmlx.config import EngineConfig


def test_compilation_config_sets_the_switches_it_names_and_leaves_the_rest():
    config = EngineConfig(compilation_config='{"skinny_gemm": false, "fuse_norms": true, "prefill_kernel": null}')
    assert (config.skinny_gemm, config.fuse_norms, config.prefill_kernel) == (False, True, None)
    assert config.compile_decode is None and config.merge_projections is None


@pytest.mark.parametrize("value, error", [
    ({"bogus": True}, "unknown key 'bogus'"),
    ({"skinny_gemm": "yes"}, "skinny_gemm must be true, false or null, got 'yes'"),
    ("{not json", "compilation_config must be a JSON object"),
    ("[1]", "compilation_config must be a JSON object, got [1]"),
])
def test_compilation_config_refuses_what_it_does_not_know(value, error):
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig(compilation_config=value)


def test_the_cli_takes_the_json_and_the_old_flags_as_aliases():
    parse = make_parser().parse_args
    assert engine_config(parse(["serve", "-O", '{"skinny_gemm": false}'])).skinny_gemm is False
    assert engine_config(parse(["serve", "--no-skinny-gemm"])).skinny_gemm is False
    assert engine_config(parse(["serve", "--fuse-norms"])).fuse_norms is True
    assert engine_config(parse(["serve"])).skinny_gemm is None


def test_the_cli_names_a_bad_compilation_config_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        engine_config(make_parser().parse_args(["serve", "--compilation-config", '{"nope": 1}']))
    assert exc.value.code == 2 and "unknown key 'nope'" in capsys.readouterr().err
