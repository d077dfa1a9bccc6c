"""The mesh provider's credential and membership keys: config errors name the key and the value; ``ethen up``
keeps one mesh token in its data directory and puts it in the gateway config it serves."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from ethen.gateway.config import parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.providers.mesh import MeshProvider
from ethen.mesh.certs import make_certs
from ethen.up_config import gateway_document
from ethen.up_state import mesh_token_file


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


def _doc(**mesh: Any) -> dict[str, Any]:
    return {"providers": [{"id": "mesh", "kind": "mesh", **mesh}],
            "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh"}],
            "api_keys": [{"name": "t", "sha256": "0" * 64}]}


W = {"workers": {"a": "127.0.0.1:5001"}}


@pytest.mark.parametrize(("mesh", "message"), [
    ({**W, "ca_file": "/no/such/ca.pem"}, "providers[0].ca_file = '/no/such/ca.pem': no such file"),
    ({**W, "token_file": "/no/token"}, "providers[0].token_file = '/no/token': no such file"),
    ({**W, "token_env": "1BAD"}, "providers[0].token_env = '1BAD'"),
    ({**W, "join": "localhost"}, "providers[0].join = 'localhost': must be 'host:port'"),
    ({"workers": {}}, "providers[0].workers = {}: Dictionary should have at least 1 item (list a worker, "
                      "or set join)"),
    ({**W, "join": "0.0.0.0:7000"}, "join = '0.0.0.0:7000': a non-loopback registry needs tls_cert"),
])
def test_bad_mesh_credentials_keys_are_named(mesh: dict[str, Any], message: str) -> None:
    with pytest.raises(GatewayConfigError) as info:
        parse_config(_doc(**mesh))
    assert message in info.value.message


def test_half_a_tls_pair_and_two_token_sources_are_refused(certs: dict[str, Path]) -> None:
    with pytest.raises(GatewayConfigError, match="set both or neither"):
        parse_config(_doc(**W, tls_cert=str(certs["server.pem"])))
    with pytest.raises(GatewayConfigError, match="set one"):
        parse_config(_doc(**W, token_file=str(certs["token"]), token_env="MESH_TOKEN"))


def test_a_join_only_mesh_and_a_secured_public_registry_are_accepted(certs: dict[str, Path]) -> None:
    parse_config(_doc(join="127.0.0.1:7000", token_env="MESH_TOKEN"))
    parse_config(_doc(join="127.0.0.1:7000", insecure=True))
    parse_config(_doc(join="0.0.0.0:7000", tls_cert=str(certs["server.pem"]),
                      tls_key=str(certs["server.key"]), token_file=str(certs["token"])))


def test_an_unset_token_env_is_named_when_the_provider_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETHEN_TEST_MESH_TOKEN", raising=False)
    cfg = parse_config(_doc(**W, token_env="ETHEN_TEST_MESH_TOKEN"))
    with pytest.raises(GatewayConfigError) as info:
        MeshProvider.from_config(cfg.providers[0])  # type: ignore[arg-type]
    assert info.value.message == ("providers[id='mesh'].token_env = 'ETHEN_TEST_MESH_TOKEN': variable is not "
                                  "set")


def test_a_bad_token_file_is_named_when_the_provider_is_built(tmp_path: Path) -> None:
    weak = tmp_path / "weak"
    weak.write_text("short\n")
    cfg = parse_config(_doc(**W, token_file=str(weak)))
    with pytest.raises(GatewayConfigError, match=r"providers\[id='mesh'\]\.token file .*at least 16"):
        MeshProvider.from_config(cfg.providers[0])  # type: ignore[arg-type]


def test_ethen_up_keeps_one_private_mesh_token_and_configures_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETHEN_DATA_DIR", str(tmp_path))
    path = mesh_token_file()
    token = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token.strip()) >= 40
    assert mesh_token_file() == path and path.read_text() == token  # kept across runs
    doc = gateway_document("127.0.0.1", 8080, "ethen-" + "k" * 40, {"a": "127.0.0.1:5001"},
                           token_file=str(path))
    assert doc["providers"][0]["token_file"] == str(path)
    assert parse_config(doc).providers[0].token_file == str(path)  # type: ignore[union-attr]
