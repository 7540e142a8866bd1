"""``import specla_hf`` and ``specla --help`` stay light: no model library, no torch, until a model is used."""
import subprocess
import sys


def _imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_import_specla_hf_imports_no_model_library():
    assert not {"torch", "transformers", "fla", "triton"} & _imported_after("import specla_hf")


def test_cli_help_and_a_bad_flag_are_answered_without_torch():
    code = ("import contextlib, io\nfrom specla_hf.app import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    assert cli.main(['bench', '--max-new-tokens', '0']) == 2\n"
            "    try:\n        cli.main(['generate', '--help'])\n    except SystemExit:\n        pass")
    assert "torch" not in _imported_after(code)
    help_text = subprocess.run([sys.executable, "-m", "specla_hf.app.cli", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "generate" in help_text and "bench" in help_text and "demo" in help_text
