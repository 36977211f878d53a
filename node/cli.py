"""The `shoal` command line: start a node, show its identity, hardware, status and peers."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from node.config import NodeConfig, default_data_dir, load_config
from protocol.errors import ShoalError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Shoal: a peer-to-peer compute node for decentralized training.")
log = logging.getLogger("shoal.cli")

SHUTDOWN_S = 4.5
"""How long a clean stop may take after SIGINT/SIGTERM before the process gives up waiting."""

DataDir = typer.Option(None, "--data-dir", help="Node data directory (identity, shards, checkpoints).")
Url = typer.Option(None, "--url", help="Control API URL of the node (default: found through --data-dir).")


def _print_version(value: bool) -> None:
    if value:
        from node.metrics import build_info
        labels = build_info()[3]
        typer.echo(f"shoal {labels['version']} (python {labels['python']}, torch {labels['torch']}, "
                   f"libp2p {labels['libp2p']})")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print the version (and torch's and libp2p's) and exit.")) -> None:
    """Shoal: a peer-to-peer compute node for decentralized training."""


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"shoal: error: {message}", err=True)
    raise typer.Exit(code)


def run_cli(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ShoalError as exc:
        fail(str(exc))


def _client(data_dir: Optional[Path], url: Optional[str]):
    """The running node's control client: its Unix socket, or --url; the token comes from the data dir."""
    from node.control import client_for
    return client_for(data_dir or _data_dir_default(), url)


def _data_dir_default() -> Path:
    env = os.environ.get("SHOAL_DATA_DIR")
    return Path(env).expanduser() if env else default_data_dir()


@app.command()
def start(
    config: Optional[Path] = typer.Option(None, "--config", help="TOML config file."),
    data_dir: Optional[Path] = DataDir,
    listen: Optional[List[str]] = typer.Option(None, "--listen", help="Multiaddr to listen on (repeatable)."),
    bootstrap: Optional[List[str]] = typer.Option(None, "--bootstrap", help="Peer multiaddr with /p2p/ (repeatable)."),
    announce_addr: Optional[List[str]] = typer.Option(None, "--announce-addr",
                                                      help="Address peers should dial, e.g. a public IP (repeatable)."),
    mdns: Optional[bool] = typer.Option(None, "--mdns/--no-mdns", help="Find peers on the local network."),
    port_mapping: Optional[bool] = typer.Option(
        None, "--port-mapping/--no-port-mapping", help="Ask the home router (NAT-PMP or UPnP) to forward the listen port."),
    control_port: Optional[int] = typer.Option(None, "--control-port", help="Control API port (0: any free one)."),
    log_json: Optional[bool] = typer.Option(None, "--log-json/--no-log-json", help="Log one JSON object per line."),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug, info, warning or error."),
) -> None:
    """Run a node until SIGINT or SIGTERM."""
    flags = {"data_dir": data_dir, "listen": listen or None, "bootstrap": bootstrap or None,
             "announce_addrs": announce_addr or None, "mdns": mdns, "port_mapping": port_mapping,
             "control_port": control_port, "log_json": log_json, "log_level": log_level}
    env_config = os.environ.get("SHOAL_CONFIG")
    cfg = run_cli(lambda: load_config(path=config or (Path(env_config) if env_config else None), flags=flags))
    from node.logs import setup_logging
    from node.preflight import check_startup
    run_cli(lambda: check_startup(cfg))
    setup_logging(cfg.log_level, json_lines=cfg.log_json)
    code = _run_daemon(cfg)
    # Everything is stopped and on disk by now. Interpreter teardown (torch's and libp2p's
    # finalizers) takes another 1-5 s on a loaded machine, which would push a clean stop past
    # a supervisor's grace period; skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    from node.logs import close_stderr_relay
    close_stderr_relay()
    os._exit(code)


class _NodeEnded(Exception):
    """run_node returned although nobody asked it to stop: the node no longer serves."""


def _run_daemon(cfg: NodeConfig) -> int:
    """Run the node until a signal; 0 after a clean stop, 2 for a user's mistake, 1 for anything else."""
    import trio

    from node.daemon import run_node
    from node.services import default_services

    stopping = threading.Event()

    def give_up() -> None:
        if not stopping.wait(SHUTDOWN_S):
            log.error("shutdown took longer than %.1f s; exiting anyway", SHUTDOWN_S)
            os._exit(1)

    async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
        await run_node(cfg, services=default_services(), task_status=task_status)
        raise _NodeEnded("the node stopped by itself")

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                node = await nursery.start(serve)
                print(f"shoal ready peer_id={node.keypair.peer_id} control={node.control_url} "
                      f"addrs={','.join(node.membership.advertised_addrs())}", flush=True)
                async for signum in signals:
                    log.info("received %s, stopping", signal.Signals(signum).name)
                    threading.Thread(target=give_up, daemon=True).start()
                    nursery.cancel_scope.cancel()
                    break

    code = 0
    try:
        trio.run(main)
    except* KeyboardInterrupt:
        pass
    except* ShoalError as group:
        # One line for the user; the first error is the cause, later ones are its consequences.
        typer.echo(f"shoal: error: {_first_leaf(group)}", err=True)
        code = 2
    except* _NodeEnded:
        log.error("the node stopped by itself; see the log above for why")
        code = 1
    except* Exception as group:
        log.critical("the node failed", exc_info=group)
        code = 1
    finally:
        stopping.set()
    if code == 0:
        log.info("stopped")
    return code


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


@app.command("id")
def show_id(data_dir: Optional[Path] = DataDir) -> None:
    """Print this node's peer id and the multiaddrs to hand to others."""
    def go() -> None:
        from node import identity
        from node.daemon import READY_FILE
        directory = data_dir or _data_dir_default()
        keypair = identity.load_or_create(directory)
        typer.echo(keypair.peer_id)
        ready = directory / READY_FILE
        if ready.exists():
            for addr in json.loads(ready.read_text()).get("addrs", []):
                typer.echo(addr)
        else:
            cfg = load_config(flags={"data_dir": directory})
            for addr in cfg.announce_addrs or cfg.listen:
                typer.echo(f"{addr}/p2p/{keypair.peer_id}  (when running)")
    run_cli(go)


@app.command()
def hw(as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
       benchmark: bool = typer.Option(True, "--benchmark/--no-benchmark", help="Run the short matmul benchmark.")) -> None:
    """Detect GPUs, CPU, memory and torch devices, and measure matmul TFLOP/s."""
    from node import hw as hardware
    report = hardware.detect(benchmark=benchmark)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=1))
    else:
        from rich.console import Console
        hardware.render(report, Console())


def _show(endpoint: str, data_dir: Optional[Path], url: Optional[str], as_json: bool, view: str) -> None:
    from node import views
    data = run_cli(lambda: _client(data_dir, url).call(endpoint))
    if as_json:
        typer.echo(json.dumps(data, indent=1))
    else:
        getattr(views, view)(data)


@app.command()
def status(data_dir: Optional[Path] = DataDir, url: Optional[str] = Url,
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Show the running node's status."""
    _show("/status", data_dir, url, as_json, "print_status")


@app.command()
def peers(data_dir: Optional[Path] = DataDir, url: Optional[str] = Url,
          as_json: bool = typer.Option(False, "--json")) -> None:
    """List the peers the running node knows, with state and hardware."""
    _show("/peers", data_dir, url, as_json, "print_peers")


@app.command()
def dashboard(data_dir: Optional[Path] = DataDir) -> None:
    """Print the running node's dashboard URL (with its control token: keep it to yourself)."""
    def go() -> str:
        from node.control import read_token
        from node.daemon import read_ready_file
        directory = data_dir or _data_dir_default()
        return f"{read_ready_file(directory)['control_url']}/?token={read_token(directory)}"
    typer.echo(run_cli(go))


def main() -> None:
    from node.dataset_cli import dataset_app, model_app
    from node.ledger_cli import ledger
    from node.shard_cli import shard_app
    from node.task_cli import task_app
    app.add_typer(shard_app, name="shard")
    app.add_typer(task_app, name="task")
    app.add_typer(dataset_app, name="dataset")
    app.add_typer(model_app, name="model")
    app.command("ledger")(ledger)
    app()


if __name__ == "__main__":
    sys.exit(main())
