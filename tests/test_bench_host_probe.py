"""The host-speed probe: a positive, repeatable reading; bad sizes named; the script's CPU path."""

import json

import pytest

from sglang_diffkv.bench import host_probe as probe


def test_python_loop_reads_positive_and_scales_with_size():
    small = probe.python_loop_ms(repeat=3, n=2_000)
    large = probe.python_loop_ms(repeat=3, n=200_000)
    assert 0 < small < large


@pytest.mark.parametrize("repeat,n", [(0, 10), (1, 0), (-1, 5)])
def test_python_loop_rejects_bad_sizes(repeat, n):
    with pytest.raises(ValueError, match=f"repeat={repeat}, n={n}"):
        probe.python_loop_ms(repeat, n)


def test_probe_script_writes_one_json_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    out = tmp_path / "probe.json"
    assert probe.main(["--repeat", "1", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["python_loop_ms"] > 0 and "launch_us" not in printed


@pytest.mark.parametrize("args,named", [(["--repeat", "0"], "--repeat 0"),
                                        (["--watch", "0"], "--watch 0.0")])
def test_probe_script_names_bad_options(args, named, capsys):
    with pytest.raises(SystemExit) as e:
        probe.main(args)
    assert e.value.code == 2 and named in capsys.readouterr().err
