"""``ethen shadows`` and ``ethen shadows promote`` (issue 27) against a live gateway over real HTTP: the
summary table, a refused promotion (exit 1, the reason), an accepted one (the running gateway's canary, and
with ``--config`` a ``[[canaries]]`` table appended to the file)."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import tomli_w
from typer.testing import CliRunner

from ethen.cli import app
from ethen.gateway.config import load_config
from tests.gateway.service_harness import config_dict, live
from tests.gateway.shadow.harness import ADMIN_KEY, TOOLS, USER, config, rule, shadow_live

runner = CliRunner()
BODY = {"model": "ethen/fast", "messages": USER, "max_tokens": 50}


def test_table_refused_and_accepted_promotion_written_to_the_config(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule(min_samples=2)]) as lv:
        common = ["--url", lv.gateway.url, "--admin-key", ADMIN_KEY]
        assert lv.post(BODY).status_code == 200
        lv.wait_pairs(1)
        res = runner.invoke(app, ["shadows", *common])
        assert res.exit_code == 0, res.output
        head, row = res.output.splitlines()[:2]
        assert head.split()[:4] == ["alias", "candidate", "percent", "n"]
        assert row.split()[:5] == ["ethen/fast", TOOLS, "100", "1", "100.0%"]
        assert "no (n = 1 < min_samples = 2)" in row
        promote = ["shadows", "promote", "--alias", "ethen/fast", "--candidate", TOOLS]
        res = runner.invoke(app, [*promote, *common])
        assert res.exit_code == 1 and "promotion_refused" in res.output and "min_samples = 2" in res.output
        assert lv.gw.canaries == ()

        assert lv.post(BODY).status_code == 200
        lv.wait_pairs(2)
        cfg_file = tmp_path / "gateway.toml"
        cfg_file.write_text("# my gateway\n" + tomli_w.dumps(config("http://127.0.0.1:9", [rule()], lv.db)))
        before = cfg_file.read_text()
        res = runner.invoke(app, ["shadows", "promote", "--alias", "ethen/fast", "--candidate", TOOLS,
                                  "--percent", "20", "--config", str(cfg_file), *common])
        assert res.exit_code == 0, res.output
        assert "is now a canary of ethen/fast at 20%" in res.output and str(cfg_file) in res.output
        assert [(c.alias, c.candidate, c.percent) for c in lv.gw.canaries] == [("ethen/fast", TOOLS, 20)]
        text = cfg_file.read_text()
        assert text.startswith(before)  # appended: the file's own text (its comment too) is kept
        canaries = load_config(cfg_file).canaries
        assert [(c.alias, c.candidate, c.percent, c.min_samples) for c in canaries] == [
            ("ethen/fast", TOOLS, 20, 2)]
        res = runner.invoke(app, ["shadows", "promote", "--alias", "ethen/fast", "--candidate", TOOLS,
                                  "--config", str(cfg_file), *common])
        assert res.exit_code == 2 and "canaries[0] is already" in res.output
        assert len(tomllib.loads(cfg_file.read_text())["canaries"]) == 1
        res = runner.invoke(app, ["shadows", "--json", "--candidate", TOOLS, *common])
        assert res.exit_code == 0 and '"canary": 20' in res.output  # the refused file stopped the second one


def test_bad_input_and_no_gateway(tmp_path: Path) -> None:
    with shadow_live(tmp_path, [rule()]) as lv:
        common = ["--url", lv.gateway.url, "--admin-key", ADMIN_KEY]
        res = runner.invoke(app, ["shadows", "--alias", "ethen/nope", *common])
        assert res.exit_code == 2 and "invalid_value" in res.output and "ethen/nope" in res.output
        res = runner.invoke(app, ["shadows", "--url", lv.gateway.url, "--admin-key", "wrong"])
        assert res.exit_code == 2 and "A valid admin key is required" in res.output
    res = runner.invoke(app, ["shadows", "--url", "http://127.0.0.1:9", "--admin-key", "x"])
    assert res.exit_code == 2 and "cannot reach the gateway" in res.output


def test_a_gateway_or_config_without_store_is_a_clear_error(tmp_path: Path) -> None:
    """sweep27: against a gateway without [store] the CLI printed only ``not_found: GET ...: not found``;
    now it says that the gateway serves no shadows API and why. ``--config`` without [store] or
    [[shadows]] is refused before any request."""
    log = {"admin_key_sha256": hashlib.sha256(b"adm").hexdigest()}  # the request-log API, but no store
    with live(log=log) as lv:
        common = ["--url", lv.gateway.url, "--admin-key", "adm"]
        promote = ["shadows", "promote", "--alias", "ethen/fast", "--candidate", "beta/beta-small"]
        for args in (["shadows", *common], [*promote, *common]):
            res = runner.invoke(app, args)
            assert res.exit_code == 2, res.output
            assert "serves no shadows admin API" in res.output and "[store]" in res.output
            assert "Traceback" not in res.output
    no_store = tmp_path / "nostore.toml"
    no_store.write_text(tomli_w.dumps(config_dict("http://127.0.0.1:9")))
    res = runner.invoke(app, ["shadows", "--config", str(no_store), "--admin-key", "x"])
    assert res.exit_code == 2 and f"{no_store}: no [store] section" in res.output
    no_rules = tmp_path / "norules.toml"
    no_rules.write_text(tomli_w.dumps(config("http://127.0.0.1:9", [], f"sqlite:///{tmp_path / 'x.db'}")))
    res = runner.invoke(app, ["shadows", "promote", "--alias", "ethen/fast", "--candidate", TOOLS,
                              "--config", str(no_rules), "--admin-key", "x"])
    assert res.exit_code == 2 and f"{no_rules}: no [[shadows]] rule" in res.output
