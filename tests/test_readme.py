"""The README's claims about extras and the GPU are checked against the code and pyproject."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


IMPORT_NAMES = {"openpipe-art": "art"}  # distributions whose import name is not their own


def section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def extras_table() -> list[tuple[list[str], list[str], str]]:
    """(extras, packages, what uses them) per row of the README's extras table."""
    rows = []
    for line in section("Optional extras").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append((re.findall(r"`([\w-]+)`", cells[0]), [p.strip() for p in cells[1].split(",")], cells[2]))
    return rows


def imports(path: Path, package: str) -> bool:
    return re.search(rf"^\s*(import|from) {package}\b", path.read_text(), flags=re.M) is not None


def test_the_extras_table_names_every_extra_and_its_packages():
    rows = extras_table()
    assert sorted(e for names, _, _ in rows for e in names) == sorted(set(EXTRAS) - {"dev"})
    for names, packages, _ in rows:
        declared = [re.split(r"[<>=!~ ]", spec)[0] for name in names for spec in EXTRAS[name]]
        assert declared == packages, names


def test_each_extra_is_used_where_the_readme_says_and_nowhere_it_says_not():
    sources = list((ROOT / "src" / "grooves").rglob("*.py"))
    rows = extras_table()
    for _, packages, used_by in rows:
        for package in packages:
            module = IMPORT_NAMES.get(package, package.replace("-", "_"))
            if used_by.startswith("nothing"):
                assert not [p for p in sources if imports(p, module)], package
            else:
                named = re.findall(r"`([\w/]+\.py)`", used_by)  # paths from the repo root or from src/
                files = [next(f for f in (ROOT / n, ROOT / "src" / n) if f.exists()) for n in named]
                assert files and all(imports(f, module) for f in files), package
    assert rows and "imported only when used" not in " ".join(README.split())  # the old, untrue line


def test_no_extra_is_imported_by_import_grooves():
    code = ("import sys, grooves, grooves.cli, grooves.training, grooves.serve, grooves.envs; "
            "print(' '.join(m for m in ('wandb', 'datasets', 'trl', 'matplotlib', 'ray', 'vllm') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == ""


def test_the_gpu_section_config_is_valid_and_says_what_is_tested():
    from grooves.training.config import parse_config

    gpu = section("On a GPU")
    [block] = re.findall(r"```toml\n(.*?)```", gpu, flags=re.S)
    config = parse_config(tomllib.loads(block))
    assert (config.model.device, config.model.dtype, config.train.group_size, config.optim.micro_batch_size) == \
        ("auto", "bfloat16", 16, 32)
    assert "CPU only" in gpu and "No test runs\non CUDA" in gpu
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("make test")
