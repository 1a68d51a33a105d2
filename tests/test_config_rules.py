"""Rules of the shared settings parser that no other test pinned: each spelling of a boolean,
the float bounds, blank list entries, the internal credential's alphabet, the flag named by a
later check, --help's defaults, service-link values, unknown-name hints, and the address checks
at their boundaries."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common import config
from services.common.config import ConfigError, load_config, require_addresses
from tests.test_config import DemoConfig


@pytest.mark.parametrize(("raw", "want"), [
    ("1", True), ("true", True), ("yes", True), ("on", True), (" ON\n", True), ("True", True),
    ("0", False), ("false", False), ("no", False), ("off", False), (" Off ", False),
])
def test_every_documented_spelling_of_a_boolean_reads_as_it_says(raw, want):
    """true/false, yes/no, on/off and 1/0, in any case and with surrounding whitespace (a YAML
    value, a pasted newline)."""
    cfg = load_config(DemoConfig, "demo", [], environ={"TIERCACHE_DEMO_ENABLED": raw})
    assert cfg.enabled is want


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "1e9000", "1000000001", "-1000000001"])
def test_a_float_setting_must_be_finite_and_at_most_1e9_in_size(raw):
    """nan/inf, and durations past MAX_FLOAT_SETTING either way, are refused naming the
    variable (they overflow Event.wait and gRPC deadlines)."""
    with pytest.raises(ConfigError, match="^TIERCACHE_DEMO_RATIO: "):
        load_config(DemoConfig, "demo", [], environ={"TIERCACHE_DEMO_RATIO": raw})


@pytest.mark.parametrize("raw", ["1e9", "-1e9", "0"])
def test_a_float_setting_of_exactly_1e9_in_size_is_taken(raw):
    """MAX_FLOAT_SETTING itself is allowed (the bound is "at most")."""
    cfg = load_config(DemoConfig, "demo", [], environ={"TIERCACHE_DEMO_RATIO": raw})
    assert cfg.ratio == float(raw)


def test_blank_list_entries_are_dropped():
    """A trailing or doubled comma is no entry (the clients ignore blanks too)."""
    cfg = load_config(DemoConfig, "demo", [], environ={"TIERCACHE_DEMO_PEERS": "a:1,, b:2 ,"})
    assert cfg.peers == ("a:1", "b:2")


def test_an_internal_token_may_use_every_printable_ascii_character():
    """0x21..0x7E travel as gRPC metadata: '!' and '~' (the range's ends) are taken."""
    from services.prefix.config import PrefixConfig

    token = "!" + "A" * 20 + "~"
    cfg = load_config(PrefixConfig, "prefix", [], {"TIERCACHE_PREFIX_INTERNAL_TOKEN": token})
    assert cfg.internal_token == token


def test_a_later_check_names_the_flag_only_when_the_flag_itself_was_given():
    """named_as_given: `--num-blocks=0` and `--num-blocks 0` are the flag; a longer flag that
    merely starts alike is not, and a message about another prefix is left alone."""
    msg = "TIERCACHE_DEMO_NUM_BLOCKS: no such file"
    want = "--num-blocks (env TIERCACHE_DEMO_NUM_BLOCKS): no such file"
    assert config.named_as_given(msg, "demo", ["--num-blocks=0"]) == want
    assert config.named_as_given(msg, "demo", ["--num-blocks", "0"]) == want
    assert config.named_as_given(msg, "demo", ["--num-blocks-max", "0"]) == msg
    # kvpool's variable in prefix's message (two prefixes of one length): not prefix's flag.
    other = "TIERCACHE_KVPOOL_NUM_BLOCKS: no such file"
    assert config.named_as_given(other, "prefix", ["--num-blocks", "0"]) == other


def test_help_shows_an_empty_list_default_as_none():
    """An empty tuple default is "none" in --help, as an empty string is."""
    import dataclasses

    peers = {f.name: f for f in dataclasses.fields(DemoConfig)}["peers"]
    assert config._shown_default(peers) == "none"


@pytest.mark.parametrize("host", ["\u3164", "\u200b", "\u200b\u3164", "dns:///\u3164",
                                  "ipv4:\u200b"])
def test_a_host_of_only_invisible_characters_is_no_host(host):
    """errors.blank's rule: "\u3164:50054" passed as host:port (isspace() is False for it), and
    a replica announcing it was taken by the index and handed out by every Match, though
    nobody could read it and gRPC resolves no such name. A visible character is a host."""
    from services.common.config import announce_problem

    for listen in (False, True):
        assert not config.is_host_port(f"{host}:1", listen=listen)
    assert announce_problem(f"{host}:1") != ""
    assert config.is_host_port("h\u3164:1")


@pytest.mark.parametrize("host", ["[]", "[\u200b]", "dns:///[]"])
def test_empty_brackets_are_no_host(host):
    """"[]:50054" passed as host:port where ":50054" did not: gRPC parses no such name, so
    a service told to listen there failed its start with "the port is in use, or the host
    is not an address of this machine", a list to dial failed every call (UNAVAILABLE
    "Unparsable name"), and the index took it from a replica and handed it out in Match."""
    from services.common.config import announce_problem

    for listen in (False, True):
        assert not config.is_host_port(f"{host}:1", listen=listen)
    assert announce_problem(f"{host}:1") != ""
    with pytest.raises(ConfigError, match=r"TIERCACHE_PREFIX_ADDRESS: .* is not host:port"):
        config.require_listen_address(f"{host}:1", "prefix")
    assert config.is_host_port("[::1]:1", listen=True) and config.is_host_port("[::]:0",
                                                                               listen=True)


def test_port_bounds_differ_for_listening_and_dialing():
    """0 (any free port) only for an address to listen on; 65535 is a port; a gRPC target is
    dialed, never listened on; a bracketed IPv6 host is dialed, a bare one is not."""
    assert config.is_host_port("h:0", listen=True) and not config.is_host_port("h:0")
    assert config.is_host_port("h:65535") and config.is_host_port("h:65535", listen=True)
    assert not config.is_host_port("h:65536", listen=True)
    assert config.is_host_port("dns:///h:1") and not config.is_host_port("dns:///h:1",
                                                                         listen=True)
    assert config.is_host_port("[fd00::1]:1", dialed=True)
    assert not config.is_host_port("fd00::1:1", dialed=True)


def test_one_address_twice_in_other_case_is_refused_naming_both():
    """Shards are placed by the canonical address: `kv:1` and `KV:1` are one replica."""
    with pytest.raises(ConfigError, match="kv:1 and KV:1 name the same address"):
        require_addresses(["kv:1", "KV:1"], "demo", "peers", allow_none=False)


@pytest.mark.parametrize(("name", "value"), [
    ("TIERCACHE_DEMO_SEMANTIC_SERVICE_HOST", "semantic.local"),  # a host name: no link's
    ("TIERCACHE_DEMO_PORT_50051_TCP_ADDR", "kvpool-0"),
    ("TIERCACHE_DEMO_SERVICE_PORT", "grpc"),  # Kubernetes writes the number
])
def test_a_service_link_name_with_a_value_of_another_form_is_a_typo(name, value):
    """Kubernetes' service-link variables pass by name and by the form of their value (an IP
    address, a port number): the same name holding anything else is refused."""
    with pytest.raises(ConfigError, match=f"^{name}: not a setting"):
        load_config(DemoConfig, "demo", [], environ={name: value})


def test_a_bad_grpc_target_gets_no_ipv6_hint():
    """The bracket hint is for a bare IPv6 host, not for a dns:/// target's colon."""
    with pytest.raises(ConfigError) as e:
        require_addresses(["dns:///a b:1"], "demo", "peers", allow_none=False)
    assert str(e.value) == "TIERCACHE_DEMO_PEERS: 'dns:///a b:1' is not host:port"


@pytest.mark.parametrize(("name", "hint"), [
    ("TIERCACHE_DEMO_ENABLE_TLS", None),  # another feature, not a misspelt ENABLED
    ("TIERCACHE_DEMO_ENABLD", "TIERCACHE_DEMO_ENABLED"),
])
def test_an_unknown_name_is_hinted_only_at_a_close_setting(name, hint):
    """The hint names a setting only when it is a near spelling of the name given; a merely
    similar name (ENABLE_TLS, about 0.7 alike) gets none rather than a wrong one."""
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", [], environ={name: "1"})
    msg = str(e.value)
    assert msg.startswith(name)
    assert (f"did you mean {hint}?" in msg) if hint else "did you mean" not in msg


@dataclass(frozen=True)
class TokenConfig:
    internal_token: str = ""


@pytest.mark.parametrize(("argv", "env", "named"), [
    (["--internal-token", "a b"], {}, "--internal-token:"),
    (["--internal-token=tok\u00e9n"], {"TIERCACHE_DEMO2_INTERNAL_TOKEN": "ok"},
     "--internal-token:"),
    ([], {"TIERCACHE_DEMO2_INTERNAL_TOKEN": "a b"}, "TIERCACHE_DEMO2_INTERNAL_TOKEN:"),
])
def test_a_token_that_is_no_metadata_is_named_as_given(argv, env, named):
    """A credential with a space or an accent is refused naming what the user typed: the flag
    was blamed on TIERCACHE_<SVC>_INTERNAL_TOKEN, which was not set."""
    with pytest.raises(ConfigError) as e:
        load_config(TokenConfig, "demo2", argv, environ=env)
    assert str(e.value).startswith(named)


@pytest.mark.parametrize("name", ["TIERCACHE_DEMO_num_blocks", "TIERCACHE_DEMO_Num_Blocks",
                                  "TIERCACHE_DEMO_num_block"])
def test_a_setting_spelt_in_small_letters_is_hinted_at(name):
    """Variable names are case-sensitive: `TIERCACHE_DEMO_num_blocks` is no setting and is
    refused, naming the setting it spells (it got no hint: compared in its own case it was
    not alike enough)."""
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", [], environ={name: "1"})
    assert str(e.value).startswith(f"{name} (did you mean TIERCACHE_DEMO_NUM_BLOCKS?)")


@pytest.mark.parametrize("address", ["a:1;b:2", "a:1;b:2;c:3", "[::1]:1;[::2]:2"])
def test_a_list_in_the_wrong_separator_gets_no_ipv6_hint(address):
    """`a:1;b:2` is two addresses in the wrong separator, not an IPv6 host to bracket."""
    with pytest.raises(ConfigError) as e:
        require_addresses([address], "demo", "peers", allow_none=False)
    msg = str(e.value)
    assert "brackets" not in msg and "separated by commas" in msg


@pytest.mark.parametrize(("var", "raw", "want"), [
    ("TIERCACHE_DEMO_NUM_BLOCKS", "abc", "expected a whole number, got 'abc'"),
    ("TIERCACHE_DEMO_NUM_BLOCKS", "1.5", "expected a whole number, got '1.5'"),
    ("TIERCACHE_DEMO_RATIO", "half", "expected a number, got 'half'"),
])
def test_a_number_setting_that_is_no_number_is_named_in_plain_words(var, raw, want):
    """Python's own words ("invalid literal for int() with base 10: 'abc'") were the
    message a service stopped with at boot."""
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", [], environ={var: raw})
    assert str(e.value) == f"{var}: {want}"


@pytest.mark.parametrize("service", ["orchestrator", "semantic", "prefix", "kvpool"])
def test_help_says_what_each_setting_means_from_the_notes_settings_md_shows(service, capsys,
                                                                             monkeypatch):
    """--help listed each variable and default but not what it meant; now each flag's help
    ends with the first sentence (or head) of the note docs/settings.md shows for it, %s and
    all (argparse %-formats help: "3.4%" raised)."""
    import dataclasses
    import importlib
    import re

    cls = next(v for k, v in vars(importlib.import_module(f"services.{service}.config")).items()
               if k.endswith("Config") and dataclasses.is_dataclass(v))
    notes = config.field_notes(cls)
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping ("comma-" / "separated")
    with pytest.raises(SystemExit):
        load_config(cls, service, ["--help"])
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    for f in dataclasses.fields(cls):
        assert notes.get(f.name), f"{f.name}: no note (docs/settings.md's meaning is empty)"
        head = config.summary(notes[f.name])
        assert len(head) <= config.SUMMARY_CHARS + 4
        var = config.env_name(service, f.name)
        shown = config._shown_default(f)
        stands = config.default_stands_for(notes[f.name], shown)
        shown += f" ({stands})" if stands and stands not in head else ""
        assert f"{var}; default {shown} {head}" in out, f.name
    assert "docs/settings.md" in out


def test_a_sentinel_default_says_what_it_stands_for_in_help(capsys, monkeypatch):
    """"default 0" said nothing where the note's "0 = ..." fell outside the first sentence
    (kvpool max_context: 0 = the model's own context)."""
    from services.kvpool.config import KvPoolConfig

    monkeypatch.setenv("COLUMNS", "2000")
    with pytest.raises(SystemExit):
        load_config(KvPoolConfig, "kvpool", ["--help"])
    out = capsys.readouterr().out
    assert ("TIERCACHE_KVPOOL_MAX_CONTEXT; default 0 (the model's max_position_embeddings)"
            in out)
    assert config.default_stands_for("-1 = off, 0 = any free port", "-1") == "off"
    assert config.default_stands_for("-1 = off, 0 = any free port", "0") == "any free port"
    assert config.default_stands_for("0 = automatic: 16 with tokens", "0") == "automatic"
    assert config.default_stands_for("Slots. 10 = ten, 0.5 = half", "0") == ""
    # An empty default is shown as none and written "" in notes (semantic snapshot_path).
    assert config.default_stands_for('Where. "" = <db_path>.hnsw. More.', "none") == (
        "<db_path>.hnsw")
    # A clause in brackets ends at its bracket; a full stop is one before a space or the end,
    # not a dot inside the clause (a path's suffix, a decimal).
    assert config.default_stands_for("A tenant's cap (0 = none): past it", "0") == "none"
    assert config.default_stands_for('Graphs; "" = <db_path>.hnsw. More.', '""') == "<db_path>.hnsw"
    assert config.default_stands_for("Saved (0 = every 0.5 s idle)", "0") == "every 0.5 s idle"


def test_a_meaning_for_help_is_its_first_sentence_or_a_head_outside_brackets():
    long = "Blocks are ranked by use count (LFU, a count halving per hour) " + "x" * 200
    assert config.summary("Port to listen on. 0 = any free one.") == "Port to listen on."
    assert config.summary("Listens on e.g. 0.0.0.0 here. More.") == "Listens on e.g. 0.0.0.0 here."
    assert config.summary("Draft lengths: " + "y " * 100) == "Draft lengths ..."
    assert config.summary(long) == "Blocks are ranked by use count ..."


@pytest.mark.parametrize("service", ["orchestrator", "semantic", "prefix", "kvpool"])
def test_each_help_line_reads_as_the_settings_meaning_on_its_own(service):
    """--help shows a note's first sentence alone: prefix cold_after_ticks read
    "...unless used within ...", min_deep_hits ended "pruned first...", and a group's heading
    above a field's note ("Thresholds.", "Server.", "Semantic tier defaults.") or a note that
    gave only its values ('"" = $TIERCACHE_CACHE_DIR ...', "-1 = off, ...") stood in for what
    the setting is."""
    import dataclasses
    import importlib
    import re

    cls = next(v for k, v in vars(importlib.import_module(f"services.{service}.config")).items()
               if k.endswith("Config") and dataclasses.is_dataclass(v))
    notes = config.field_notes(cls)
    headings = {"thresholds.", "server.", "semantic tier defaults.",
                "defaults and limits per request."}
    for f in dataclasses.fields(cls):
        head = config.summary(notes[f.name])
        assert not head.startswith("..."), f.name
        assert not re.search(r"\w\.\.\.$", head), f.name  # "first..." runs on to the next
        assert head.lower() not in headings and len(head.split()) >= 3, (f.name, head)
        assert not re.match(r'("[^"]*"|-?\d+|empty) = ', head), (f.name, head)


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan"])
def test_a_float_setting_that_is_not_finite_is_called_so(raw):
    """inf is refused as not finite, not as "at most 1e+09 in size" (true, but not the
    problem: the value is no number of seconds at all)."""
    with pytest.raises(ConfigError, match="expected a finite number"):
        load_config(DemoConfig, "demo", [], environ={"TIERCACHE_DEMO_RATIO": raw})


def test_a_services_tls_files_are_no_unknown_setting():
    """TIERCACHE_<SERVICE>_TLS_CERT/_KEY/_CLIENT_AUTH are read by the server's TLS set-up, not
    by a field: the typo check must not refuse them (every TLS deployment would not start)."""
    env = {f"TIERCACHE_DEMO_{n}": "x" for n in ("TLS_CERT", "TLS_KEY", "TLS_CLIENT_AUTH")}
    assert load_config(DemoConfig, "demo", [], environ=env).num_blocks == 8


def test_a_secret_of_exactly_the_minimum_length_is_not_weak():
    """MIN_SECRET_CHARS is the shortest secret taken without a warning."""
    n = config.MIN_SECRET_CHARS
    secret = "k3Q9xT2mW8vR5zLp" * 4
    assert config.weak_secret(secret[:n]) == ""
    assert "shorter than" in config.weak_secret(secret[:n - 1])


def test_a_config_class_has_its_source_read_once_not_at_every_load(monkeypatch):
    """--help's meanings come from the class's source (inspect + ast: ~8 ms for a service's
    class, ~100x the rest of a load): read at every load_config, they tripled
    test_config_differential's time and went into every start whether or not help was asked.
    Read once per class."""
    import inspect

    @dataclass
    class Once:
        # The one setting.
        level: int = 1

    real, reads = inspect.getsourcelines, []
    monkeypatch.setattr(config.inspect, "getsourcelines",
                        lambda obj: reads.append(obj) or real(obj))
    for _ in range(3):
        assert load_config(Once, "demo", [], environ={}).level == 1
    assert config.field_notes(Once) == {"level": "The one setting."}
    assert len(reads) == 1
