"""`streamkit shards …` against a real KeySpace (and, for stat, a real running member).

KeySpace-only commands run in-process through click's CliRunner on an app
folder whose KeySpace is seeded the way `streamkit run` and the allocator
write it. stat runs as a subprocess, since the member it asks runs in the
test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from streamkit.app.assignment import MemberId
from streamkit.app.config import AppConfig, load_config
from streamkit.app.deploy import ensure_shard_specs
from streamkit.app.member import deploy
from streamkit.app.shard_ops import apply_shards
from streamkit.cli.main import cli
from streamkit.client import BrokerClient
from streamkit.keyspace import open_keyspace
from streamkit.protocol import consumer_pb
from streamkit.protocol import recoverylog_pb2 as rpb
from tests.brokerproc import free_port
from tests.helpers_client import eventually
from tests.test_shard_api import (
    TIMEOUT,
    add_member,
    all_primary,
    app_document,
    app_name,
    assign,
    publish_lines,
    running_member,
)

Code = consumer_pb.ReplicaStatus.Code


def app_folder(folder: Path, shards: int = 2) -> AppConfig:
    """An app folder with streamkit.yaml and an empty data folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "streamkit.yaml").write_text(yaml.safe_dump(app_document(app_name(), shards)))
    config = load_config(folder)
    config.data_dir.mkdir()
    return config


def make_app(folder: Path, shards: int = 2) -> AppConfig:
    """An app folder with streamkit.yaml and the KeySpace `streamkit run` would have made."""
    config = app_folder(folder, shards)

    async def seed() -> None:
        async with open_keyspace(str(config.data_dir / "keyspace.db")) as keyspace:
            await ensure_shard_specs(keyspace, config.keyspace_root, config.shard_specs())

    asyncio.run(seed())
    return config


def keyspace_do(config: AppConfig, action: Any) -> Any:
    """Run `action(keyspace, root)` on the app's KeySpace."""
    async def run() -> Any:
        async with open_keyspace(str(config.data_dir / "keyspace.db")) as keyspace:
            return await action(keyspace, config.keyspace_root)

    return asyncio.run(run())


def shards(*args: str) -> Result:
    result = CliRunner().invoke(cli, ["shards", *args], catch_exceptions=False)
    assert "Traceback" not in result.stderr
    return result


def ok(*args: str) -> str:
    result = shards(*args)
    assert result.exit_code == 0, result.stderr
    return result.stdout


def fails(*args: str, code: int) -> str:
    result = shards(*args)
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert result.stderr.startswith("streamkit: error: "), result.stderr
    return result.stderr


@pytest.fixture
def app(tmp_path: Path) -> AppConfig:
    return make_app(tmp_path / "app")


def seed_assignments(config: AppConfig) -> None:
    async def action(keyspace: Any, root: str) -> None:
        m1 = MemberId("local", "wrk1")
        await add_member(keyspace, root, m1, "grpc://127.0.0.1:7001")
        await assign(keyspace, root, "shard-000", m1, 0, Code.PRIMARY)
        await assign(keyspace, root, "shard-001", m1, 0, Code.FAILED, "shard broke")

    keyspace_do(config, action)


# --- list ------------------------------------------------------------------------------------


def test_list_table_json_yaml_and_selectors(app: AppConfig) -> None:
    where = ["--app", str(app.app_dir)]
    table = ok("list", *where).splitlines()
    assert table[0].split() == ["ID", "STATUS", "PRIMARY", "STANDBYS", "REVISION", "LABELS"]
    assert [line.split()[:2] for line in table[1:]] == [["shard-000", "UNASSIGNED"],
                                                         ["shard-001", "UNASSIGNED"]]
    seed_assignments(app)
    result = shards("list", *where)
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "PRIMARY" in rows["shard-000"] and "local#wrk1 (grpc://127.0.0.1:7001)" in \
        rows["shard-000"]
    assert "FAILED" in rows["shard-001"]
    assert "shard-001 at local#wrk1: FAILED: shard broke" in result.stderr

    listed = json.loads(ok("list", *where, "-l", "id=shard-001", "-o", "json"))
    assert [s["id"] for s in listed] == ["shard-001"]
    assert listed[0]["route"] == [{"member": "local#wrk1", "endpoint": "grpc://127.0.0.1:7001",
                                   "primary": True, "status": "FAILED",
                                   "errors": ["shard broke"]}]
    assert listed[0]["spec"]["sources"][0]["journal"] == f"{app.name}/lines/part-001"
    assert json.loads(ok("list", *where, "-l", f"app={app.name}", "--format", "json"))[1]["id"] \
        == "shard-001"
    assert json.loads(ok("list", *where, "-l", "app=other", "-o", "json")) == []

    document = yaml.safe_load(ok("list", *where, "-o", "yaml"))
    assert [s["id"] for s in document["shards"]] == ["shard-000", "shard-001"]
    assert all(s["revision"] > 0 for s in document["shards"])

    assert "bad label selector" in fails("list", *where, "-l", "a=(", code=2)


def test_list_finds_the_keyspace_or_explains(app: AppConfig, tmp_path: Path) -> None:
    keyspace = str(app.data_dir / "keyspace.db")
    other = tmp_path / "elsewhere"
    other.mkdir()
    listed = json.loads(ok("list", "--app", str(other), "--keyspace", keyspace,
                           "--root", app.keyspace_root, "-o", "json"))
    assert [s["id"] for s in listed] == ["shard-000", "shard-001"]
    # --keyspace without --root takes the root from the app folder's streamkit.yaml.
    assert len(json.loads(ok("list", "--app", str(app.app_dir), "--keyspace", keyspace,
                             "-o", "json"))) == 2
    empty = shards("list", "--app", str(other), "--keyspace", keyspace, "--root",
                   "/gazette/consumers/typo")
    assert empty.exit_code == 0 and empty.stdout.count("\n") == 1, empty.stdout  # the header
    assert "no shards under /gazette/consumers/typo in this KeySpace" in empty.stderr
    assert "--keyspace needs --root" in fails("list", "--app", str(other), "--keyspace",
                                              keyspace, code=2)
    assert "is this an app folder" in fails("list", "--app", str(other), code=2)
    assert "--root must be an absolute" in fails("list", "--keyspace", keyspace, "--root",
                                                 "relative", code=2)
    assert "no KeySpace at" in fails("list", "--keyspace", str(other / "none.db"), "--root",
                                     "/gazette/consumers/x", code=1)
    fresh = make_app(tmp_path / "fresh")
    (fresh.data_dir / "keyspace.db").unlink()
    assert "the app hasn't run here yet" in fails("list", "--app", str(fresh.app_dir), code=1)
    # query alike: opening the missing file made an empty KeySpace, and `shards list` then
    # showed an app without shards rather than this error.
    asked = CliRunner().invoke(cli, ["query", str(fresh.app_dir), "{}"])
    assert asked.exit_code == 1 and "the app hasn't run here yet" in asked.stderr, asked.stderr
    assert not (fresh.data_dir / "keyspace.db").exists()


# --- apply -----------------------------------------------------------------------------------


def test_apply_round_trip_dry_run_stale_and_delete(app: AppConfig, tmp_path: Path) -> None:
    where = ["--app", str(app.app_dir)]
    document = yaml.safe_load(ok("list", *where, "-o", "yaml"))
    document["shards"][0]["hot_standbys"] = 1
    document["shards"].append({"id": "shard-extra", "sources": [{"journal": "extra/input"}],
                               "labels": [{"name": "app", "value": "extra"}]})
    specs = tmp_path / "shards.yaml"
    specs.write_text(yaml.safe_dump(document))
    before = ok("list", *where, "-o", "yaml")

    dry = ok("apply", str(specs), *where, "--dry-run")
    assert "would update shard-000" in dry and "hot_standbys: 0 -> 1" in dry
    assert "would create shard-extra" in dry and "unchanged shard-001" in dry
    assert "dry run, nothing applied" in dry
    assert ok("list", *where, "-o", "yaml") == before

    done = ok("apply", str(specs), *where)
    assert "updated shard-000 (revision" in done and "created shard-extra" in done
    assert "1 created, 1 updated, 0 deleted, 1 unchanged" in done
    listed = {s["id"]: s for s in json.loads(ok("list", *where, "-o", "json"))}
    assert listed["shard-000"]["spec"]["hot_standbys"] == 1
    assert listed["shard-extra"]["spec"]["labels"] == [  # (the store's, common to all)
        {"name": "app", "value": "extra"}, {"name": "app.streamkit.dev/store", "value": "rocksdb"}]

    # The same file again changes nothing (and so checks no revision)...
    assert "0 created, 0 updated, 0 deleted, 3 unchanged" in ok("apply", str(specs), *where)
    # ...but changes from it meet shard-000's stale revision, and shard-extra existing.
    document["shards"][0]["hot_standbys"] = 2
    document["shards"][2]["disable"] = True
    specs.write_text(yaml.safe_dump(document))
    stale = fails("apply", str(specs), *where, code=1)
    assert "shard shard-000 changed since revision" in stale
    assert "shard shard-extra already exists" in stale

    deleting = {"shards": [{"id": "shard-extra", "delete": True,
                            "revision": listed["shard-extra"]["mod_revision"]}]}
    specs.write_text(yaml.safe_dump(deleting))
    assert "deleted shard-extra (was revision" in ok("apply", str(specs), *where)
    assert "shard-extra" not in ok("list", *where)
    specs.write_text(yaml.safe_dump({"shards": [{"id": "shard-000", "delete": True}]}))
    assert "deleting needs the revision" in fails("apply", str(specs), *where, code=2)


def test_apply_reports_invalid_files(app: AppConfig, tmp_path: Path) -> None:
    where = ["--app", str(app.app_dir)]
    specs = tmp_path / "bad.yaml"
    specs.write_text(yaml.safe_dump({"shards": [
        {"id": "shard-bad", "max_txn_duration": "0s"},
        {"id": "shard-worse", "hot_standbys": -1, "colour": "red"}]}))
    error = fails("apply", str(specs), *where, code=2)
    assert 'shard "shard-bad": max_txn_duration' in error
    assert 'shard "shard-worse": colour: unknown field' in error
    assert 'shard "shard-worse": hot_standbys' in error
    assert "cannot read shard file" in fails("apply", str(tmp_path / "none.yaml"), *where,
                                             code=2)
    specs.write_text("shards: [")
    assert "bad.yaml" in fails("apply", str(specs), *where, code=2)
    assert "shard-bad" not in ok("list", *where)


# --- forget --------------------------------------------------------------------------------------


def test_forget_lets_sql_shards_start_over(tmp_path: Path, app: AppConfig) -> None:
    """Deletes the shards' checkpoint rows and commit marks, not other shards'; refuses
    shards still assigned, unknown shards, and apps whose stores are recorded."""
    import sqlalchemy as sa

    from streamkit.app.commit_marks import mark_committed, mark_key
    from streamkit.stores.sql import CHECKPOINTS

    folder = tmp_path / "sql-app"
    folder.mkdir()
    (folder / "streamkit.yaml").write_text(
        yaml.safe_dump(app_document(app_name(), 2, store={"kind": "sql"})))
    config = load_config(folder)
    config.data_dir.mkdir()
    engine = sa.create_engine(config.sql_url())
    CHECKPOINTS.create(engine)
    with engine.begin() as conn:
        for sid in ("shard-000", "shard-001"):
            conn.execute(sa.insert(CHECKPOINTS).values(
                shard_fqn=f"{config.keyspace_root}/items/{sid}", fence=3, checkpoint=b"x"))

    async def seed(keyspace: Any, root: str) -> None:
        await ensure_shard_specs(keyspace, root, config.shard_specs())
        for sid in ("shard-000", "shard-001"):
            await mark_committed(keyspace, root, sid, "db")

    keyspace_do(config, seed)
    where = ["--app", str(folder)]
    result = shards("forget", "shard-001", *where)
    assert result.exit_code == 0, result.stderr
    assert "forgot 1 shard: 1 checkpoint row and 1 KeySpace mark deleted" in result.stderr

    with engine.connect() as conn:
        left = conn.execute(sa.select(CHECKPOINTS.c.shard_fqn)).scalars().all()
    assert left == [f"{config.keyspace_root}/items/shard-000"]

    async def marks(keyspace: Any, root: str) -> list[bool]:
        return [await keyspace.get(mark_key(root, s)) is not None
                for s in ("shard-000", "shard-001")]

    assert keyspace_do(config, marks) == [True, False]
    assert "shard not found: shard-009" in fails("forget", "shard-009", *where, code=2)
    seed_assignments(config)
    assert "shard-000 still assigned to members: stop the app" in fails(
        "forget", "shard-000", *where, code=1)
    assert keyspace_do(config, marks) == [True, False]
    assert "for apps with the sql store" in fails(
        "forget", "shard-000", "--app", str(app.app_dir), code=2)
    engine.dispose()


# --- unassign and hints ------------------------------------------------------------------------


def test_unassign_failed_shard(app: AppConfig) -> None:
    where = ["--app", str(app.app_dir)]
    seed_assignments(app)

    async def assigned(keyspace: Any, root: str) -> list[str]:
        kvs, _ = await keyspace.range(f"{root}/assign/")
        return [kv.key.removeprefix(f"{root}/assign/") for kv in kvs]

    before = keyspace_do(app, assigned)
    result = shards("unassign", "shard-000", "shard-001", "--only-failed", "--dry-run", *where)
    assert result.exit_code == 0 and result.stdout == "shard-001\n"
    assert "would unassign 1 shard" in result.stderr
    everyone = shards("unassign", "--only-failed", "--dry-run", *where)  # every shard's
    assert (everyone.exit_code, everyone.stdout) == (0, "shard-001\n"), everyone.stderr
    assert keyspace_do(app, assigned) == before
    assert ok("unassign", "shard-000", "shard-001", "--only-failed", *where) == "shard-001\n"
    assert keyspace_do(app, assigned) == ["shard-000#local#wrk1#0"]
    again = shards("unassign", "shard-001", "--only-failed", *where)
    assert again.stdout == "" and "nothing to unassign" in again.stderr
    assert "SHARD_NOT_FOUND): shard-999" in fails("unassign", "shard-000", "shard-999", *where,
                                                  code=1)
    assert "shard-000" in ok("unassign", "shard-000", *where)  # a healthy primary, too
    assert keyspace_do(app, assigned) == []
    refused = shards("unassign", *where)
    assert refused.exit_code == 2 and "name the shards to unassign" in refused.stderr


def test_unassign_only_failed_of_an_app_without_shards(app: AppConfig, tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"

    async def make() -> None:
        async with open_keyspace(str(empty)):
            pass

    asyncio.run(make())
    result = shards("unassign", "--only-failed", "--app", str(app.app_dir), "--keyspace",
                    str(empty))
    assert result.exit_code == 0 and "nothing to unassign (no shards)" in result.stderr


def test_hints(app: AppConfig) -> None:
    where = ["--app", str(app.app_dir)]
    empty = json.loads(ok("hints", "shard-000", *where))
    assert empty == {"shard": "shard-000", "primary": None, "backups": [None, None]}

    async def with_hints(keyspace: Any, root: str) -> None:
        spec = app.shard_specs()[0]
        hints = rpb.FSMHints(log=f"recovery/{app.name}/shard-000",
                             properties=[rpb.Property(path="/IDENTITY", content="x")])
        response = await apply_shards(keyspace, root, [consumer_pb.ApplyRequest.Change(
            expect_mod_revision=-1, upsert=spec, primary_hints=hints)])
        assert response.status == consumer_pb.OK

    keyspace_do(app, with_hints)
    shown = json.loads(ok("hints", "shard-000", *where))
    assert shown["primary"]["log"] == f"recovery/{app.name}/shard-000"
    assert shown["primary"]["properties"] == [{"path": "/IDENTITY", "content": "x"}]
    assert "shard shard-404 not found" in fails("hints", "shard-404", *where, code=1)
    assert "shard:" in fails("hints", "x", *where, code=2)  # not a valid shard id


# --- stat ------------------------------------------------------------------------------------


def test_stat_errors_without_a_running_primary(app: AppConfig) -> None:
    where = ["--app", str(app.app_dir)]
    assert "shard shard-000 has no primary right now" in fails("stat", "shard-000", *where,
                                                              code=1)
    assert "SHARD_NOT_FOUND" in fails("stat", "shard-404", *where, code=1)

    async def disable(keyspace: Any, root: str) -> None:
        spec = app.shard_specs()[1]
        spec.disable = True
        await ensure_shard_specs(keyspace, root, [spec])

    keyspace_do(app, disable)
    assert "shard shard-001 is disabled (its spec's `disable`)" in fails(
        "stat", "shard-001", *where, code=1)

    async def dead_primary(keyspace: Any, root: str) -> None:
        member = MemberId("local", "gone")
        await add_member(keyspace, root, member, f"grpc://127.0.0.1:{free_port()}")
        await assign(keyspace, root, "shard-000", member, 0, Code.PRIMARY)

    keyspace_do(app, dead_primary)
    assert "cannot reach shard shard-000's primary local#gone" in fails(
        "stat", "shard-000", *where, "--timeout", "5", code=1)

    # Without --read-through a timeout is the primary's silence, not the offsets': a
    # primary whose port takes connections (the kernel's backlog) but never speaks.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        async def silent_primary(keyspace: Any, root: str) -> None:
            await add_member(keyspace, root, MemberId("local", "gone"),
                             f"grpc://127.0.0.1:{silent.getsockname()[1]}")

        keyspace_do(app, silent_primary)
        err = fails("stat", "shard-000", *where, "--timeout", "0.5", code=1)
        assert "primary local#gone" in err and "did not answer within 0.5s" in err, err
    assert "JOURNAL=OFFSET" in shards("stat", "shard-000", *where, "--read-through",
                                      "nonsense").stderr


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamkit.cli.main", "shards", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert b"Traceback" not in err, err.decode()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_stat_asks_the_running_primary(shared_broker: Any, tmp_path: Path) -> None:
    folder = tmp_path / "app"
    config = app_folder(folder, 1)
    path = config.data_dir / "keyspace.db"
    where = ["--app", str(folder)]
    async with BrokerClient(shared_broker.address) as client:
        async with open_keyspace(str(path)) as keyspace:
            await deploy(config, client, keyspace)
        async with running_member(config, client, path, "wrk0", allocate=True) as running:
            await eventually(lambda: all_primary(running.member, 1), TIMEOUT)
            ends = await publish_lines(client, config, ["one two", "two three"])
            (journal, end), = ends.items()
            code, out, err = await _cli("stat", "shard-000", *where, "--read-through",
                                        f"{journal}={end}", "-o", "json")
            assert code == 0, err
            answer = json.loads(out)
            assert answer["shard"] == "shard-000" and answer["member"] == "local#wrk0"
            assert answer["endpoint"] == f"grpc://127.0.0.1:{running.port}"
            assert answer["read_through"][journal] >= end
            assert answer["status"] == "PRIMARY" and answer["transactions"] >= 1

            code, out, err = await _cli("stat", "shard-000", *where)
            assert code == 0, err
            assert out.splitlines()[0].split() == ["JOURNAL", "OFFSET"]
            assert f"read       {journal}" in out
            assert f"published  {config.name}/counts/part-000" in out
            assert "shard-000: PRIMARY at local#wrk0" in err and "last commit" in err

            code, out, err = await _cli("stat", "shard-000", *where, "--read-through",
                                        f"{journal}={end + 10**6}", "--timeout", "0.5")
            assert code == 1 and "did not read through the given offsets within 0.5s" in err


async def test_consumer_address_reaches_shards_through_a_member(shared_broker: Any,
                                                                tmp_path: Path) -> None:
    """--consumer (or gazctl's $CONSUMER_ADDRESS): every command through one member's Shard
    API, without the app's folder or KeySpace, as gazctl works."""
    folder = tmp_path / "app"
    config = app_folder(folder, 2)
    path = config.data_dir / "keyspace.db"
    elsewhere = ["--app", str(tmp_path / "no-app-here")]  # nothing is found through it
    async with BrokerClient(shared_broker.address) as client:
        async with open_keyspace(str(path)) as keyspace:
            await deploy(config, client, keyspace)
        async with running_member(config, client, path, "worker-0", allocate=True) as running:
            await eventually(lambda: all_primary(running.member, 2), TIMEOUT)
            member = f"http://127.0.0.1:{running.port}"
            code, out, err = await _cli("list", *elsewhere, "--consumer", member, "-o", "json")
            assert code == 0, err
            assert [(s["id"], s["status"]) for s in json.loads(out)] == [
                ("shard-000", "PRIMARY"), ("shard-001", "PRIMARY")]
            env = {"CONSUMER_ADDRESS": member}
            code, out, err = await _cli("stat", "shard-001", *elsewhere, "-o", "json", env=env)
            assert code == 0, err
            assert json.loads(out)["member"] == "local#worker-0"
            # The primary's endpoint as its route says, not the address dialled.
            assert json.loads(out)["endpoint"] == f"grpc://127.0.0.1:{running.port}", out
            code, out, err = await _cli("hints", "shard-000", *elsewhere, env=env)
            assert code == 0 and json.loads(out)["shard"] == "shard-000", err
            code, out, err = await _cli("unassign", "shard-000", "--dry-run", *elsewhere,
                                        env=env)
            assert code == 0 and out.split() == ["shard-000"], err
            code, _, err = await _cli("unassign", "shard-404", *elsewhere, env=env)
            assert code == 1 and "shard not found (SHARD_NOT_FOUND): shard-404" in err, err
            code, _, err = await _cli("stat", "bad id!", *elsewhere, env=env)
            assert code == 2 and "INVALID_ARGUMENT" in err, err
    code, _, err = await _cli("list", *elsewhere, "--consumer", f"127.0.0.1:{free_port()}")
    assert code == 1 and "UNAVAILABLE" in err and "member 127.0.0.1:" in err, err


@pytest.mark.parametrize("url", ["http://x:1/a", "etcd://no-port", "etcd:/typo/app/"])
def test_a_keyspace_url_in_no_accepted_form_is_bad_input(tmp_path: Path, url: str) -> None:
    """Exit 2 naming the URL, from every command taking --keyspace (serve said 1)."""
    assert CliRunner().invoke(cli, ["new", "kapp", "--dir", str(tmp_path)]).exit_code == 0
    app_dir = str(tmp_path / "kapp")
    for args in (["shards", "list", "--app", app_dir], ["query", app_dir, "{}"],
                 ["serve", app_dir, "--broker", "127.0.0.1:1"]):
        result = CliRunner().invoke(cli, [*args, "--keyspace", url])
        assert result.exit_code == 2, (args, result.stderr)
        assert result.stderr.startswith(f"streamkit: error: {url}") or (
            f"invalid etcd URL '{url}'" in result.stderr), (args, result.stderr)


def test_serve_refuses_a_store_other_than_the_deployed_one(app: AppConfig) -> None:
    """A member started with another --store than the shards were deployed with found
    none of their state: it recounted their sources from the start, or failed at the
    app's first use of the other store."""
    (app.app_dir / "app.py").write_text(
        "from streamkit import Application\n\n\nclass WordCount(Application):\n"
        "    def consume_message(self, shard, store, envelope, publisher):\n        pass\n")
    result = CliRunner().invoke(cli, ["serve", str(app.app_dir), "--broker", "127.0.0.1:1",
                                      "--store", "sqlite"])
    assert result.exit_code == 2, result.stderr
    assert ("refusing to serve: app " + app.name + "'s shards keep their state in the "
            "rocksdb store") in result.stderr, result.stderr
    assert "this member would run sqlite (--store)" in result.stderr
