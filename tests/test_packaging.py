"""The Space's requirements.txt and pyproject.toml must not drift apart."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_requirements_match_pyproject_dependencies():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = [line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    required = [line for line in lines if line and not line.startswith("#")]
    assert sorted(required) == sorted(declared)
    # Gradio's OAuth routes import authlib and itsdangerous, which only its "oauth" extra brings.
    assert any(line.startswith("gradio[oauth]") for line in required)


def test_readme_front_matter_configures_the_space():
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("---\n")
    front = readme.split("---\n")[1]
    for line in ("sdk: gradio", "app_file: app.py", "hf_oauth: true", "python_version:"):
        assert line in front
    gradio_pin = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                      if d.startswith("gradio"))
    version = front.split("sdk_version: ")[1].split()[0]
    assert version.startswith("6."), (version, gradio_pin)
