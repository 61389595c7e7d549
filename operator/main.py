"""`rlfleet operator run`: the operator, in a cluster (service account, peering for HA) or out of it.

    rlfleet operator run [--namespace NS ...| --all-namespaces] [--kubeconfig PATH]
                         [--peering NAME | --standalone] [--priority N|auto]
                         [--liveness URL] [--metrics-port PORT] [--verbose]
                         [--webhook-port P [--webhook-cert F --webhook-key F |
                          --webhook-cert-secret S --webhook-configuration C]]

Peering: kopf freezes every operator of a peering that sees a higher-priority peer, so HA replicas
need distinct priorities: `--priority auto` hashes $POD_NAME (or the host name) into 1..2^30.
Install kopf's peering CRDs (the Helm chart does) for named peerings; without them use --standalone.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys


def auto_priority(identity: str) -> int:
    """A stable priority in [1, 2^30] from a pod name (distinct per replica with high probability)."""
    return 1 + int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "big") % (2**30)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlfleet operator run", description="run the rlfleet operator (kopf)"
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster service account, else $KUBECONFIG)"
    )
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", help="kopf peering name (HA: one active operator per peering)")
    peering.add_argument("--standalone", action="store_true", help="no peering")
    parser.add_argument("--priority", default="0", help="peering priority: an integer or 'auto'")
    parser.add_argument("--liveness", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port")
    parser.add_argument(
        "--metrics-address", default="0.0.0.0", help="bind address of /metrics (default 0.0.0.0)"
    )
    parser.add_argument(
        "--webhook-port", type=int, help="serve the validating webhook (live-catalog rules) here"
    )
    parser.add_argument("--webhook-address", default="0.0.0.0", help="bind address of the webhook server")
    parser.add_argument(
        "--webhook-host", default="127.0.0.1", help="name/IP the API server uses to reach the webhook"
    )
    parser.add_argument("--webhook-cert", help="TLS certificate (PEM) of the webhook; default: self-signed")
    parser.add_argument("--webhook-key", help="TLS private key (PEM) of the webhook")
    parser.add_argument(
        "--webhook-cert-secret",
        metavar="NAME",
        help="keep the webhook's CA and certificate in this Secret (created if missing, renewed "
        "before expiry, shared by every replica); needs --webhook-configuration",
    )
    parser.add_argument(
        "--webhook-cert-secret-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        help="namespace of --webhook-cert-secret (default: $POD_NAMESPACE)",
    )
    parser.add_argument(
        "--webhook-configuration",
        metavar="NAME",
        help="ValidatingWebhookConfiguration whose caBundle the operator sets from that Secret",
    )
    parser.add_argument(
        "--webhook-cert-check-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how often each replica re-reads that Secret and the caBundle (default 60)",
    )
    parser.add_argument(
        "--webhook-managed",
        action="store_true",
        help="let the operator create the ValidatingWebhookConfiguration rlfleet.dev",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser.parse_args(argv)


def cli(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.priority == "auto":
        priority = auto_priority(os.environ.get("POD_NAME") or socket.gethostname())
    else:
        try:
            priority = int(args.priority)
        except ValueError:
            print(
                f"rlfleet operator run: --priority must be an integer or 'auto', got {args.priority!r}",
                file=sys.stderr,
            )
            return 2
    if args.kubeconfig:
        if not os.path.isfile(args.kubeconfig):
            print(f"rlfleet operator run: kubeconfig {args.kubeconfig!r} not found", file=sys.stderr)
            return 2
        os.environ["KUBECONFIG"] = args.kubeconfig
    if not args.namespace and not args.all_namespaces:
        print("rlfleet operator run: give --namespace NS (repeatable) or --all-namespaces", file=sys.stderr)
        return 2
    from rlfleet.operator.logs import configure_logging

    configure_logging(args.verbose)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_address)

    problem = _webhook_problem(args) or _network_policy_problem()
    if problem:
        print(f"rlfleet operator run: {problem}", file=sys.stderr)
        return 2
    import kopf

    import rlfleet.operator.handlers  # noqa: F401  (registers every handler)

    if args.webhook_port:
        _enable_webhook(args)

    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        standalone=args.standalone or None,
        peering_name=args.peering,
        priority=priority,
        liveness_endpoint=args.liveness,
    )
    return 0


def _webhook_problem(args: argparse.Namespace) -> str | None:
    """Why the webhook's flags do not go together (None: they do)."""
    if args.webhook_cert_check_interval <= 0:
        return f"--webhook-cert-check-interval must be positive, got {args.webhook_cert_check_interval:g}"
    if bool(args.webhook_cert) != bool(args.webhook_key):
        return "--webhook-cert and --webhook-key go together"
    if not args.webhook_cert_secret:
        return "--webhook-configuration needs --webhook-cert-secret" if args.webhook_configuration else None
    if args.webhook_cert:
        return "--webhook-cert-secret and --webhook-cert/--webhook-key are two ways to give the certificate: pick one"
    if args.webhook_managed:
        return "--webhook-cert-secret sets the caBundle of --webhook-configuration; --webhook-managed would create another"
    if not args.webhook_configuration:
        return "--webhook-cert-secret needs --webhook-configuration (whose caBundle the operator sets)"
    if not args.webhook_cert_secret_namespace:
        return "--webhook-cert-secret needs --webhook-cert-secret-namespace (or $POD_NAMESPACE)"
    return None


def _network_policy_problem() -> str | None:
    """Why the NetworkPolicy settings of the environment cannot be used (None: they can)."""
    from rlfleet.operator.network_policies import settings_from_env

    try:
        settings_from_env()
    except ValueError as exc:
        return str(exc)
    return None


def _enable_webhook(args: argparse.Namespace) -> None:
    """Hand the webhook's listen address and TLS files to kopf's admission setup (through the
    environment) and register the validating handlers."""
    from rlfleet.operator.admission import WEBHOOK_ENV

    os.environ[WEBHOOK_ENV["port"]] = str(args.webhook_port)
    os.environ[WEBHOOK_ENV["addr"]] = args.webhook_address
    os.environ[WEBHOOK_ENV["host"]] = args.webhook_host
    if args.webhook_cert:
        os.environ[WEBHOOK_ENV["cert"]] = args.webhook_cert
        os.environ[WEBHOOK_ENV["key"]] = args.webhook_key
    if args.webhook_cert_secret:
        os.environ[WEBHOOK_ENV["secret"]] = args.webhook_cert_secret
        os.environ[WEBHOOK_ENV["secret_namespace"]] = args.webhook_cert_secret_namespace
        os.environ[WEBHOOK_ENV["configuration"]] = args.webhook_configuration
        os.environ[WEBHOOK_ENV["check_interval"]] = str(args.webhook_cert_check_interval)
    if args.webhook_managed:
        os.environ[WEBHOOK_ENV["managed"]] = "1"
    import rlfleet.operator.webhook  # noqa: F401  (registers the validating handlers)
