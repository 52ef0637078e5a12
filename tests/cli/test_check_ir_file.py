"""`fcir check` of a hand-edited IR text file names the line of each error and, for a
misspelt op, the op meant."""

import jax.numpy as jnp

import fcir
from fcir import cli


def _round_text() -> str:
    @fcir.program(placements={"clients": 4})
    def r(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: w + x, (fcir.broadcast(w), x)))

    return fcir.capture(r, jnp.zeros(3), jnp.zeros((4, 3))).to_text()


def _line(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if marker in line)


def test_a_misspelt_fed_op_names_its_line_and_the_op_meant(tmp_path, capsys):
    text = _round_text().replace("fed.broadcast", "fed.braodcast")
    path = tmp_path / "edited.fcir"
    path.write_text(text)
    assert cli.main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"at edited.fcir:{_line(text, 'fed.braodcast')}:" in out
    assert "unknown federated op fed.braodcast (did you mean 'fed.broadcast'?)" in out


def test_an_unknown_op_inside_a_region_names_its_line(tmp_path, capsys):
    text = _round_text().replace("jax.add", "fcir.constnat")
    path = tmp_path / "edited.fcir"
    path.write_text(text)
    assert cli.main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"at edited.fcir:{_line(text, 'fcir.constnat')}:" in out
    assert "unknown op fcir.constnat (did you mean 'fcir.constant'?)" in out


def test_checking_a_file_keeps_the_location_the_text_gives(tmp_path, capsys):
    text = _round_text().replace(
        "fed.broadcast %0 {to=\"clients\"}", "fed.braodcast %0 {to=\"clients\"} loc(\"r.py:3\")"
    )
    path = tmp_path / "edited.fcir"
    path.write_text(text)
    assert cli.main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"at edited.fcir:{_line(text, 'fed.braodcast')} (captured at r.py:3):" in out
