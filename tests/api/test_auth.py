"""KeyRing, check_bind and tenant_salt: keys from config and env, tenants, refusals, bind safety."""

from __future__ import annotations

import pytest

from loopstack.api.auth import (
    ANONYMOUS,
    AuthError,
    KeyRing,
    KeyRingError,
    Principal,
    UnsafeBindError,
    check_bind,
    key_fingerprint,
    tenant_salt,
)
from loopstack.stack.schema import ApiConfig

KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-bravo-9876543210"
KEY_ENV = "sk-envkey-5555"


def ring(*keys: str, env: str | None = None, env_name: str = "LOOPSTACK_API_KEYS") -> KeyRing:
    environ = {} if env is None else {env_name: env}
    return KeyRing.from_config(ApiConfig(api_keys=list(keys), api_keys_env=env_name), environ=environ)


def test_no_keys_means_auth_is_off_and_everyone_is_anonymous() -> None:
    keyring = ring()
    assert keyring.enabled is False
    assert keyring.authenticate(None) == ANONYMOUS == Principal("anonymous", "default")
    assert keyring.authenticate("Bearer whatever") == ANONYMOUS


def test_a_config_key_authenticates() -> None:
    principal = ring(KEY_A).authenticate(f"Bearer {KEY_A}")
    assert principal.key_id == key_fingerprint(KEY_A)
    assert len(principal.key_id) == 12 and KEY_A not in principal.key_id


def test_a_key_without_a_tenant_is_its_own_tenant() -> None:
    principal = ring(KEY_A).authenticate(f"Bearer {KEY_A}")
    assert principal.tenant == principal.key_id


def test_keys_can_name_a_shared_tenant() -> None:
    keyring = ring(f"{KEY_A}:acme", f"{KEY_B}:acme")
    first, second = keyring.authenticate(f"Bearer {KEY_A}"), keyring.authenticate(f"Bearer {KEY_B}")
    assert first.tenant == second.tenant == "acme"
    assert first.key_id != second.key_id
    assert keyring.statistics() == (2, 1)


def test_keys_come_from_the_environment_too() -> None:
    keyring = ring(KEY_A, env=f" {KEY_ENV}:globex , {KEY_B},")
    assert keyring.authenticate(f"Bearer {KEY_ENV}").tenant == "globex"
    assert keyring.authenticate(f"Bearer {KEY_B}").key_id == key_fingerprint(KEY_B)
    assert keyring.authenticate(f"Bearer {KEY_A}").key_id == key_fingerprint(KEY_A)


def test_the_environment_variable_name_comes_from_the_config() -> None:
    keyring = ring(env=KEY_ENV, env_name="MY_KEYS")
    assert keyring.enabled and keyring.authenticate(f"Bearer {KEY_ENV}").key_id == key_fingerprint(KEY_ENV)


def test_env_keys_alone_turn_auth_on() -> None:
    assert ring(env=KEY_ENV).enabled is True
    assert ring(env=" , ").enabled is False


def test_the_bearer_scheme_is_case_insensitive() -> None:
    assert ring(KEY_A).authenticate(f"bearer {KEY_A}").key_id == key_fingerprint(KEY_A)


def test_a_missing_header_is_refused() -> None:
    with pytest.raises(AuthError, match="missing API key") as raised:
        ring(KEY_A).authenticate(None)
    assert raised.value.code == "missing_api_key"


@pytest.mark.parametrize("header", [KEY_A, f"Basic {KEY_A}", "Bearer", f"Bearer {KEY_A} extra"])
def test_a_malformed_header_is_refused_without_echoing_the_key(header: str) -> None:
    with pytest.raises(AuthError, match="malformed") as raised:
        ring(KEY_A).authenticate(header)
    assert KEY_A not in str(raised.value)


def test_an_unknown_key_is_refused_without_echoing_it() -> None:
    with pytest.raises(AuthError, match="invalid API key") as raised:
        ring(KEY_A).authenticate("Bearer sk-stolen-guess")
    assert "sk-stolen-guess" not in str(raised.value) and raised.value.code == "invalid_api_key"


def test_a_malformed_configured_key_is_an_error_that_hides_it() -> None:
    with pytest.raises(KeyRingError, match=r"api_keys\[1\]") as raised:
        ring(KEY_A, "has space")
    assert "has space" not in str(raised.value)


def test_a_malformed_env_key_names_the_variable() -> None:
    with pytest.raises(KeyRingError, match="LOOPSTACK_API_KEYS"):
        ring(env=f"{KEY_A},bad key")


def test_a_bad_tenant_name_is_refused() -> None:
    with pytest.raises(KeyRingError, match="tenant") as raised:
        ring(f"{KEY_A}:not ok!")
    assert KEY_A not in str(raised.value)


def test_one_key_with_two_tenants_is_refused() -> None:
    with pytest.raises(KeyRingError, match="twice"):
        ring(f"{KEY_A}:acme", env=f"{KEY_A}:globex")


def test_the_keyring_repr_hides_keys() -> None:
    assert KEY_A not in repr(ring(KEY_A))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_binds_are_allowed_with_auth_off(host: str) -> None:
    check_bind(host, ring(), allow_public_bind=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "203.0.113.7", "2001:db8::1", "example.com"])
def test_public_binds_are_refused_with_auth_off(host: str) -> None:
    with pytest.raises(UnsafeBindError, match="allow_public_bind"):
        check_bind(host, ring(), allow_public_bind=False)


def test_public_binds_are_allowed_when_told_to() -> None:
    check_bind("0.0.0.0", ring(), allow_public_bind=True)


def test_public_binds_are_allowed_with_auth_on() -> None:
    check_bind("0.0.0.0", ring(KEY_A), allow_public_bind=False)


def test_tenants_get_distinct_stable_salts() -> None:
    acme, globex = Principal("k1", "acme"), Principal("k2", "globex")
    assert tenant_salt(acme) != tenant_salt(globex)
    assert tenant_salt(acme) == tenant_salt(Principal("k3", "acme"))
    assert "acme" not in tenant_salt(acme)


def test_anonymous_has_no_salt() -> None:
    assert tenant_salt(ANONYMOUS) == ""
