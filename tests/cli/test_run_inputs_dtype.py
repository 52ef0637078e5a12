"""`fcir run --inputs` of float64 arrays for a program taking float32: converted as
jax.jit converts them, with a note on stderr naming the argument."""

import textwrap

import numpy as np

from fcir import cli

_PROGRAM = textwrap.dedent(
    """
    import jax.numpy as jnp
    import fcir

    @fcir.program(placements={"clients": 2})
    def rnd(w, x):
        return fcir.reduce_mean(fcir.map_fn(lambda w, x: w + x, (fcir.broadcast(w), x)))

    EXAMPLE_ARGS = {"rnd": lambda: (jnp.zeros(2), jnp.ones((2, 2)))}
    """
)


def test_float64_inputs_are_converted_with_a_note_naming_the_argument(tmp_path, capsys):
    (tmp_path / "prog.py").write_text(_PROGRAM)
    w, x = np.asarray([0.5, 0.25]), np.ones((2, 2), np.float32)  # w: float64
    np.savez(tmp_path / "in64.npz", w, x)
    np.savez(tmp_path / "in32.npz", w.astype(np.float32), x)
    target = f"{tmp_path / 'prog.py'}:rnd"
    assert cli.main(["run", target, "--inputs", str(tmp_path / "in64.npz"),
                     "-o", str(tmp_path / "out64.npz")]) == 0
    err = capsys.readouterr().err
    assert "arr_0 is float64, converted to float32 as jax.jit does" in err
    assert "(JAX's x64 mode is off): argument w\n" in err
    assert "arr_1" not in err  # already float32: nothing to say
    assert cli.main(["run", target, "--inputs", str(tmp_path / "in32.npz"),
                     "-o", str(tmp_path / "out32.npz")]) == 0
    assert capsys.readouterr().err == ""
    np.testing.assert_array_equal(
        np.load(tmp_path / "out64.npz")["arr_0"], np.load(tmp_path / "out32.npz")["arr_0"]
    )


def test_an_ir_file_names_the_argument_by_position(tmp_path, capsys):
    (tmp_path / "prog.py").write_text(_PROGRAM)
    assert cli.main(["compile", f"{tmp_path / 'prog.py'}:rnd", "--emit", "ir",
                     "-o", str(tmp_path / "ir")]) == 0
    np.savez(tmp_path / "in64.npz", np.zeros(2), np.ones((2, 2)))
    capsys.readouterr()
    assert cli.main(["run", str(tmp_path / "ir" / "rnd.fcir"), "--inputs",
                     str(tmp_path / "in64.npz")]) == 0
    err = capsys.readouterr().err
    assert (
        "arr_0 is float64, converted to float32 as jax.jit does (JAX's x64 mode is off): "
        "argument [0]\n" in err
    )
    assert "x64 mode is off): argument [1]\n" in err
