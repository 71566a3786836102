"""The README's example must keep working as written."""
from pathlib import Path


def test_readme_scheduler_example_runs():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = readme.split("The scheduler can also be driven directly, with the simulated model:\n\n```python\n")[1].split("```")[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["finished"][0].num_output_tokens == 8
    assert scope["scheduler"].kv.device.num_used == 0


def test_simulation_demo_runs_and_reports(capsys):
    from engine.devtools.simulate import main
    main(["--users", "6", "--gpu-blocks", "40", "--cpu-blocks", "16", "--max-tokens", "24", "--every", "1000"])
    printed = capsys.readouterr().out
    assert "prefix cache served" in printed and "every block read back checked" in printed
