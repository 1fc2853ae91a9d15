"""The TCP event channel's hello, and each backend building its own options from `gpufleet run`'s flags."""

from __future__ import annotations

import socket

import pytest

from gpufleet.backends import RUN_BACKENDS, backend_class, submitter_class
from gpufleet.backends.channel import read_hello, send_hello
from gpufleet.core.errors import UsageError


def test_hello_is_read_without_consuming_the_events_after_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_hello(a, "token", "1", "node-7")
        a.sendall(b'{"ev":"step"}\n')  # the agent's first relayed event follows at once
        assert read_hello(b, 1.0) == ["token", "1", "node-7"]
        assert b.recv(64) == b'{"ev":"step"}\n'


def test_a_silent_peer_gives_an_empty_hello() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert read_hello(b, 0.05) == []


FLAGS = {
    "nodes": 3, "min_nodes": 2, "address": "head:6379", "spare_nodes": 1, "partition": "gpu",
    "time_limit": "1:00:00", "exclude": ["n9"], "job_name": "exp", "submit": False, "image": "img:1",
    "namespace": "ml", "run_claim": None,
}  # fmt: skip


def test_each_backend_builds_its_options_from_the_flags() -> None:
    assert backend_class("local").options(FLAGS) == {}
    assert backend_class("srun").options(FLAGS) == {"nodes": 3, "min_nodes": 2}
    assert backend_class("ray").options(FLAGS) == {"address": "head:6379", "nodes": 3, "min_nodes": 2}
    assert backend_class("k8s-jobs").options(FLAGS) == {}


def test_submitters_run_their_inner_backend_and_keep_the_job_flags() -> None:
    slurm = submitter_class("slurm")
    assert slurm.inner == "srun" and slurm.inner in RUN_BACKENDS
    job = slurm.from_flags(FLAGS)
    assert (job.nodes, job.spare_nodes, job.exclude, job.submit_job) == (3, 1, ("n9",), False)
    k8s = submitter_class("k8s")
    assert k8s.inner == "k8s-jobs"
    sub = k8s.from_flags(FLAGS)
    assert (sub.name, sub.image, sub.namespace, sub.apply) == ("exp", "img:1", "ml", False)


def test_an_unknown_backend_lists_every_choice() -> None:
    with pytest.raises(UsageError, match="valid backends: local, srun, ray, k8s-jobs, slurm, k8s"):
        submitter_class("moon")
    with pytest.raises(UsageError, match="k8s submits a batch job"):
        backend_class("k8s")
