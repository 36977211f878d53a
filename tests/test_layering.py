"""The dependency direction node -> p2p -> protocol holds, and only p2p/ imports libp2p."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "protocol": {"trio", "libp2p", "torch", "node", "p2p", "multiaddr", "safetensors"},
    "p2p": {"node", "torch"},
}


def imports(path):
    for item in ast.walk(ast.parse(path.read_text())):
        if isinstance(item, ast.Import):
            yield from (a.name.split(".")[0] for a in item.names)
        elif isinstance(item, ast.ImportFrom) and item.level == 0 and item.module:
            yield item.module.split(".")[0]


def test_layers_import_only_downwards():
    problems = []
    for package in ("protocol", "p2p", "node", "scripts"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in imports(path):
                if name in FORBIDDEN.get(package, ()):
                    problems.append(f"{path.relative_to(ROOT)} imports {name}")
                if name == "libp2p" and package != "p2p":
                    problems.append(f"{path.relative_to(ROOT)} imports libp2p outside p2p/")
    assert problems == []


def test_the_check_sees_files():
    assert list((ROOT / "protocol").glob("*.py"))
