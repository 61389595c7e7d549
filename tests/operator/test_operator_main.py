"""`rlfleet operator run` argument handling and the router admin tokens (pure parts; the running operator
and its Kubernetes client are tested against the real control plane)."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest

from rlfleet.operator import tokens
from rlfleet.operator.main import auto_priority, cli


def test_auto_priority_is_stable_in_range_and_distinct() -> None:
    a, b = auto_priority("rlfleet-operator-7d9f-abcde"), auto_priority("rlfleet-operator-7d9f-fghij")
    assert a == auto_priority("rlfleet-operator-7d9f-abcde") and a != b
    assert all(1 <= p <= 2**30 for p in (a, b))


# a webhook whose certificate the operator keeps in Secret s, setting the caBundle of configuration c
CERT_IN_A_SECRET = [
    "-n",
    "x",
    "--webhook-port",
    "9443",
    "--webhook-cert-secret",
    "s",
    "--webhook-configuration",
    "c",
]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--namespace", "x", "--priority", "high"], "--priority must be an integer or 'auto'"),
        (
            ["--namespace", "x", "--kubeconfig", "/nonexistent/kubeconfig"],
            "kubeconfig '/nonexistent/kubeconfig' not found",
        ),
        ([], "give --namespace NS (repeatable) or --all-namespaces"),
        # the webhook's certificate comes from files or from a Secret the operator keeps, never both
        (
            ["-n", "x", "--webhook-port", "9443", "--webhook-cert", "c.pem"],
            "--webhook-cert and --webhook-key go together",
        ),
        (
            ["-n", "x", "--webhook-port", "9443", "--webhook-configuration", "rlfleet"],
            "--webhook-configuration needs --webhook-cert-secret",
        ),
        (
            ["-n", "x", "--webhook-port", "9443", "--webhook-cert-secret", "s"],
            "--webhook-cert-secret needs --webhook-configuration (whose caBundle the operator sets)",
        ),
        (
            [*CERT_IN_A_SECRET, "--webhook-cert", "c.pem", "--webhook-key", "k.pem"],
            "two ways to give the certificate: pick one",
        ),
        (
            [*CERT_IN_A_SECRET, "--webhook-managed"],
            "--webhook-managed would create another",
        ),
        (
            CERT_IN_A_SECRET,
            "--webhook-cert-secret needs --webhook-cert-secret-namespace (or $POD_NAMESPACE)",
        ),
        (
            ["-n", "x", "--webhook-cert-check-interval", "0"],
            "--webhook-cert-check-interval must be positive, got 0",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)  # the Secret's namespace defaults to the pod's
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_network_policy_settings_stop_the_operator_at_start_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLFLEET_METRICS_FROM", '{"podSelector": {}}')  # a peer, not a list of peers
    assert cli(["-n", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "rlfleet operator run: RLFLEET_METRICS_FROM: expected a JSON list of NetworkPolicyPeers"
    )
    assert len(err.strip().splitlines()) == 1


def test_router_admin_tokens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(tokens.KEY_ENV, raising=False)
    monkeypatch.delenv(tokens.KEY_FILE_ENV, raising=False)
    assert tokens.admin_token_for("uid-1") is None
    assert tokens.new_admin_token("uid-1") != tokens.new_admin_token("uid-1")  # random without a key
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    monkeypatch.setenv(tokens.KEY_FILE_ENV, str(key_file))
    t1 = tokens.admin_token_for("uid-1")
    # the documented derivation, computed here independently: HMAC-SHA256(key, "router-admin:" + uid)
    assert t1 == hmac.new(b"s3cret", b"router-admin:uid-1", hashlib.sha256).hexdigest()
    assert t1 == tokens.new_admin_token("uid-1")
    assert t1 != tokens.admin_token_for("uid-2") and len(t1) == 64
    monkeypatch.setenv(tokens.KEY_ENV, "other")  # the value wins over the file
    assert (
        tokens.admin_token_for("uid-1")
        == hmac.new(b"other", b"router-admin:uid-1", hashlib.sha256).hexdigest()
    )


def test_collision_message_sees_child_names_taken_by_other_jobs() -> None:
    """What the webhook refuses with the namespace's indexes (CEL sees one object): job `a` with group
    `b-c` and job `a-b` with group `c` both want `a-b-c`; group `b-trainer` of job `a` is job `a-b`'s
    trainer. The job's own groups (on update) and unrelated names pass."""
    from rlfleet.operator.admission import collision_message

    def job(name: str, *groups: str) -> dict:
        return {"metadata": {"name": name}, "spec": {"samplerGroups": [{"name": g} for g in groups]}}

    def sg(name: str, job_name: str | None) -> dict:
        return {"metadata": {"name": name}, "spec": {"jobName": job_name} if job_name else {}}

    taken = collision_message(job("a", "b-c"), [job("a-b", "c")], [sg("a-b-c", "a-b")])
    assert taken is not None and "a-b-c" in taken and "RLJob a-b" in taken
    standalone = collision_message(job("a", "h100"), [], [sg("a-h100", None)])
    assert standalone is not None and "standalone" in standalone
    trainer = collision_message(job("a", "b-trainer"), [job("a-b", "c")], [])
    assert trainer is not None and "a-b-trainer" in trainer and "RLJob a-b" in trainer
    mine = collision_message(job("a", "h100"), [job("a", "h100")], [sg("a-h100", "a")])
    assert mine is None
    assert collision_message(job("a", "h100"), [job("b", "h100")], [sg("b-h100", "b")]) is None


def _job_on(name: str, namespace: str, **store: str) -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"weightChannel": {"store": store}}}


def s3(bucket: str, prefix: str) -> dict[str, str]:
    return {"type": "s3", "bucket": bucket, "prefix": prefix}


@pytest.mark.parametrize(
    ("mine", "theirs", "overlap"),
    [
        # S3: a bucket is global (another namespace counts); prefixes nest by '/' components
        (s3("w", "jobs/a"), ("other", s3("w", "jobs/a")), True),
        (s3("w", "jobs/a/b"), ("other", s3("w", "jobs/a/")), True),
        (s3("w", "jobs/a"), ("ns", s3("w", "")), True),
        (s3("w", "jobs/a"), ("ns", s3("w", "jobs/ab")), False),
        (s3("w", "jobs/a"), ("ns", s3("x", "jobs/a")), False),
        # a claim's root is mounted at `path`: one claim is one channel, whatever the paths; claims are per namespace
        ({"path": "/w/a", "volumeClaimName": "c"}, ("ns", {"path": "/w/b", "volumeClaimName": "c"}), True),
        (
            {"path": "/w/a", "volumeClaimName": "c"},
            ("other", {"path": "/w/a", "volumeClaimName": "c"}),
            False,
        ),
        ({"path": "/w/a", "volumeClaimName": "c"}, ("ns", {"path": "/w/a", "volumeClaimName": "d"}), False),
        # no claim: a directory on the nodes; nested paths overlap
        ({"type": "filesystem", "path": "/w/a/b"}, ("ns", {"path": "/w/a"}), True),
        ({"path": "/w/a"}, ("ns", {"path": "/w/ab"}), False),
        ({"path": "/w/a"}, ("ns", s3("w", "w/a")), False),
    ],
)
def test_shared_store_message_refuses_a_store_another_job_writes(
    mine: dict, theirs: tuple, overlap: bool
) -> None:
    """Two RLJobs on one weight channel (the same store, or one nested in the other) would have two
    trainers interleave their versions: the webhook refuses the second, naming the first."""
    from rlfleet.operator.admission import shared_store_message

    other_ns, other_store = theirs
    message = shared_store_message(
        _job_on("b", "ns", **mine), "ns", [_job_on("b", "ns", **mine), _job_on("a", other_ns, **other_store)]
    )
    if overlap:
        assert message is not None and f"of RLJob {other_ns}/a: one trainer per weight channel" in message
    else:
        assert message is None


def test_shared_store_message_counts_only_jobs_that_run() -> None:
    """A suspended job runs no trainer: it is admitted on a store another job writes, and does not block
    one; unsuspending it is a spec change the webhook judges then."""
    from rlfleet.operator.admission import shared_store_message

    store = {"path": "/w", "volumeClaimName": "c"}
    running, suspended = _job_on("a", "ns", **store), _job_on("b", "ns", **store)
    suspended["spec"]["suspend"] = True
    assert shared_store_message(suspended, "ns", [running]) is None
    assert shared_store_message(_job_on("c", "ns", **store), "ns", [suspended]) is None
    resumed = {**suspended, "spec": {**suspended["spec"], "suspend": False}}
    message = shared_store_message(resumed, "ns", [running, suspended])
    assert message is not None and "of RLJob ns/a:" in message
