"""cluster/: the real-cluster configs and the documented commands take the job's options; the local
cluster (cluster/local.sh) end to end: up, a dataset on its S3 volume, `ray job submit` of
jobs/train_images.py with a worker killed, checkpoints on S3 and metrics in MLflow, down."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from ray_resilient.testing import free_port

REPO = Path(__file__).parent.parent
CLUSTER = REPO / "cluster"
LOCAL_SH = CLUSTER / "local.sh"
VENV_BIN = REPO / ".venv" / "bin"
JOB = "jobs/train_images.py"
RUNS_JOB = re.compile(r"\bpython\s+\S*jobs/train_images\.py\b")  # a command line running the job


def job_args(command: str) -> list[str]:
    """The arguments of ``python .../jobs/train_images.py ...`` in a shell command line."""
    words = shlex.split(command)
    at = next(i for i, word in enumerate(words) if word.endswith(JOB))
    assert words[at - 1] == "python", f"the job is not run with the cluster's python: {command}"
    return words[at + 1:]


@functools.cache
def job_script():
    """jobs/train_images.py, the script under test, loaded from its file (jobs/ is no library)."""
    spec = importlib.util.spec_from_file_location("train_images", REPO / JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_job_args(args: list[str]):
    """The job's own parser on ``args`` (fails the test on an unknown or invalid option)."""
    try:
        return job_script().parse_args(args)
    except SystemExit as exit:
        pytest.fail(f"jobs/train_images.py rejects {shlex.join(args)} (exit {exit.code})")


def joined_lines(lines: list[str]) -> list[str]:
    """Lines with shell continuations (a trailing backslash) joined."""
    out, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            out.append(current + line)
            current = ""
    return out


def job_commands_in_comments(path: Path) -> list[str]:
    comments = [re.sub(r"^#\s?", "", line.strip()) for line in path.read_text().splitlines()
                if line.strip().startswith("#")]
    return [line.strip() for line in joined_lines(comments) if RUNS_JOB.search(line)]


def job_commands_in_code_blocks(markdown: str) -> list[str]:
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", markdown, flags=re.S)
    lines = [line.split("  #")[0] for block in blocks for line in block.splitlines()]
    return [line.strip() for line in joined_lines(lines) if RUNS_JOB.search(line)]


def local_sh(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(LOCAL_SH), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def clean_env(**settings: str) -> dict[str, str]:
    """This process's environment without anything pointing at another cluster or store."""
    drop = {"RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "MLFLOW_TRACKING_URI", "PYTHONPATH"}
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("AWS_", "RAY_RESILIENT_", "RAY_TRAIN_"))}
    return {**env, **settings}


# --- the real-cluster configs ----------------------------------------------------------------------

def test_the_launcher_config_is_a_valid_ray_cluster_config():
    path = CLUSTER / "ray-cluster.yaml"
    config = yaml.safe_load(path.read_text())
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in config, key
    assert config["provider"]["type"] == "aws"
    node_types = config["available_node_types"]
    assert config["head_node_type"] in node_types
    workers = [node for name, node in node_types.items() if name != config["head_node_type"]]
    assert any(re.match(r"(g|p)\d", node["node_config"]["InstanceType"]) for node in workers), "no GPU workers"
    assert any("pip install" in c and "ray_resilient" in c for c in config["setup_commands"])
    head_start = " ".join(config["head_start_ray_commands"])
    for setting in ("RAY_health_check_period_ms=1000", "RAY_health_check_timeout_ms=1000",
                    "RAY_health_check_failure_threshold=3", "RAY_AUTH_MODE=token", "MLFLOW_TRACKING_URI="):
        assert setting in head_start, setting
    assert "RAY_AUTH_MODE=token" in " ".join(config["worker_start_ray_commands"])
    # What `ray up` checks: Ray's schema, with the defaults it fills in.
    from ray_resilient._ray_internals import validate_cluster_config

    validate_cluster_config(config)
    # The documented job submission takes the job's options, with S3 for the data and the runs.
    commands = job_commands_in_comments(path)
    assert commands, f"no `ray job submit ... {JOB}` example in {path.name}"
    for command in commands:
        assert command.startswith("ray job submit --working-dir . -- python ")
        args = parse_job_args(job_args(command))
        assert args.volume.startswith("s3://") and args.storage_path.startswith("s3://") and args.use_gpu


def test_the_rayjob_runs_the_job_with_s3_mlflow_and_fast_failure_detection():
    path = CLUSTER / "kuberay-rayjob.yaml"
    manifest = yaml.safe_load(path.read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    spec = manifest["spec"]
    args = parse_job_args(job_args(spec["entrypoint"]))
    assert args.volume.startswith("s3://") and args.storage_path.startswith("s3://")
    assert 1 <= args.min_workers < args.max_workers and args.use_gpu
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    train_env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S",
                 "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"}
    assert train_env <= set(runtime_env["env_vars"])
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_env = {e["name"]: e.get("value") for e in head["env"]}
    assert head_env["RAY_health_check_period_ms"] == "1000"
    assert head_env["RAY_health_check_timeout_ms"] == "1000"
    assert head_env["RAY_health_check_failure_threshold"] == "3"
    groups = cluster["workerGroupSpecs"]
    assert groups and all(g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] for g in groups)
    containers = [head] + [c for g in groups for c in g["template"]["spec"]["containers"]]
    for container in containers:  # S3 credentials from the Secret, MLflow, the same image everywhere
        assert {"secretRef": {"name": "ray-resilient-s3"}} in container["envFrom"], container["name"]
        assert any(e["name"] == "MLFLOW_TRACKING_URI" for e in container["env"]), container["name"]
        assert container["image"] == head["image"]
    gpus = sum(int(g["maxReplicas"]) * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
               for g in groups for c in g["template"]["spec"]["containers"])
    assert args.max_workers <= gpus, "--max-workers asks for more GPUs than the worker groups can have"


def test_the_dockerfile_installs_the_project_where_the_rayjob_runs_it():
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    entrypoint = yaml.safe_load((CLUSTER / "kuberay-rayjob.yaml").read_text())["spec"]["entrypoint"]
    job_path = next(w for w in shlex.split(entrypoint) if w.endswith(JOB))
    assert re.search(r"^FROM rayproject/ray:2\.60\.", dockerfile, flags=re.M)
    assert "WORKDIR /app" in dockerfile and job_path == f"/app/{JOB}"
    assert re.search(r"^COPY .*\bjobs jobs$", dockerfile, flags=re.M) and "pip install" in dockerfile


def test_the_readme_commands_take_the_jobs_options():
    commands = job_commands_in_code_blocks((CLUSTER / "README.md").read_text())
    assert len(commands) >= 3
    for command in commands:
        parse_job_args(job_args(command))


# --- cluster/local.sh without a cluster ------------------------------------------------------------

def test_local_sh_example_takes_the_jobs_options(tmp_path):
    out = local_sh("example", env=clean_env(RAY_RESILIENT_CLUSTER_DIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    [command] = joined_lines(out.stdout.splitlines())
    assert command.startswith("ray job submit --working-dir . -- python jobs/train_images.py ")
    args = parse_job_args(job_args(command))
    assert args.volume == "s3://ray-resilient/shapes" and args.storage_path == "s3://ray-resilient/runs"
    assert args.faults and args.min_workers < args.max_workers
    documented = [shlex.split(c) for c in job_commands_in_code_blocks((CLUSTER / "README.md").read_text())]
    assert shlex.split(command) in documented, "cluster/README.md does not show the example `up` prints"


def test_local_sh_without_a_cluster(tmp_path):
    env = clean_env(RAY_RESILIENT_CLUSTER_DIR=str(tmp_path / "state"), RAY_RESILIENT_RAY_PORT=str(free_port()),
                    RAY_RESILIENT_DASHBOARD_PORT=str(free_port()), RAY_RESILIENT_CLIENT_PORT=str(free_port()),
                    RAY_RESILIENT_AGENT_PORT=str(free_port()), RAY_RESILIENT_S3_PORT=str(free_port()))
    down = local_sh("down", env=env)
    assert down.returncode == 0 and "no local cluster" in down.stdout
    status = local_sh("status", env=env)
    assert status.returncode == 1 and "no local cluster" in status.stdout
    assert local_sh("make-volume", env=env).returncode == 1
    usage = local_sh("frobnicate", env=env)
    assert usage.returncode == 2 and "cluster/local.sh up" in usage.stderr
    with socket.socket() as taken:  # a taken port: named, nothing started
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = local_sh("up", env={**env, "RAY_RESILIENT_MLFLOW_PORT": str(port)})
    assert up.returncode == 1 and f"port {port}" in up.stderr
    assert not list((tmp_path / "state" / "pids").glob("*.pid"))


# --- cluster/local.sh end to end -------------------------------------------------------------------

def process_tree(pids: list[int]) -> set[int]:
    """The processes of the process groups led by ``pids`` and all their descendants."""
    import psutil

    found = set()
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) in pids:
                found.add(process.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    for pid in list(found) + pids:
        try:
            found.update(child.pid for child in psutil.Process(pid).children(recursive=True))
            found.add(pid)
        except psutil.Error:
            pass
    return found


def running(pids: set[int]) -> set[int]:
    import psutil

    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.Error:
            pass
    return alive


CLASSES, PER_CLASS = 3, 60  # 180 training JPEGs, 45 for validation
# 180 // 8 = 22 steps per epoch, 66 in all, a checkpoint (ResNet-18's state, uploaded to S3) every
# 10. Rank 1 dies as soon as checkpoint 10 is complete on S3 (a kill at a fixed step could come
# before any upload finished) and the run resumes from step 10. The data loader and the goodput
# recorder log to MLflow every 5 steps (--log-every).
RUN = ["--name", "e2e", "--epochs", "3", "--global-batch", "8", "--interval", "10", "--log-every", "5",
       "--faults", "kill:durable=10:rank=1", "--min-workers", "1", "--max-workers", "2"]


# The same job in survivor mode, one epoch on the two 1-CPU nodes: rank 1 killed after step 5.
SURVIVORS_RUN = ["--name", "e2e-survivors", "--survivors", "--epochs", "1", "--global-batch", "8", "--interval", "10",
                 "--log-every", "5", "--faults", "kill:step=5:rank=1", "--max-workers", "2"]


@pytest.fixture(scope="module")
def local_cluster_run(tmp_path_factory):
    """`cluster/local.sh up` (a head and a worker node, 1 CPU each), `make-volume`, the printed
    example job submitted with a short run's options, then `down`: what each step showed."""
    state = tmp_path_factory.mktemp("cluster")
    ray_temp = tempfile.mkdtemp(prefix="rrc-", dir="/tmp")  # short: Ray's socket paths live under it
    settings = {
        "RAY_RESILIENT_CLUSTER_DIR": str(state), "RAY_RESILIENT_RAY_TEMP_DIR": ray_temp,
        "RAY_RESILIENT_RAY_PORT": str(free_port()), "RAY_RESILIENT_DASHBOARD_PORT": str(free_port()),
        "RAY_RESILIENT_CLIENT_PORT": str(free_port()), "RAY_RESILIENT_AGENT_PORT": str(free_port()),
        "RAY_RESILIENT_S3_PORT": str(free_port()), "RAY_RESILIENT_MLFLOW_PORT": str(free_port()),
    }
    env = clean_env(**settings)
    seen: dict = {"times": {}, "ray_port": settings["RAY_RESILIENT_RAY_PORT"]}
    started = time.monotonic()
    try:
        up = local_sh("up", "--workers", "1", "--cpus", "1", env=env, timeout=400)
        seen["times"]["up"] = time.monotonic() - started
        assert up.returncode == 0, f"up failed:\n{up.stdout}\n{up.stderr}"
        seen["up"] = up.stdout
        exports = [line.strip() for line in up.stdout.splitlines() if line.strip().startswith("export ")]
        seen["exports"] = exports
        client = dict(word.split("=", 1) for line in exports for word in shlex.split(line)[1:])
        seen["client_env"] = client
        seen["env_file"] = (state / "env.sh").read_text()
        job_env = {**env, **client, "PATH": f"{VENV_BIN}{os.pathsep}{env['PATH']}"}
        seen["status"] = local_sh("status", env=env, timeout=120)
        seen["pids"] = {p.stem: int(p.read_text()) for p in (state / "pids").glob("*.pid")}

        t = time.monotonic()
        volume = local_sh("make-volume", str(PER_CLASS), "--classes", str(CLASSES), env=env, timeout=300)
        seen["times"]["make-volume"] = time.monotonic() - t
        assert volume.returncode == 0, f"make-volume failed:\n{volume.stdout}\n{volume.stderr}"

        example = local_sh("example", env=env).stdout
        seen["example"] = example
        [command] = joined_lines(example.splitlines())
        words = shlex.split(command)
        ray_cli = [str(VENV_BIN / "ray"), "job"]

        def submit(name: str, run: list[str]) -> tuple[subprocess.CompletedProcess, str, str]:
            """The printed example with ``run``'s options, submitted: its outcome, status and logs."""
            at = words.index("submit")
            submission_id = f"{name}-{uuid.uuid4().hex[:8]}"
            t = time.monotonic()
            try:
                job = subprocess.run([str(VENV_BIN / "ray"), *words[1:at + 1], "--submission-id", submission_id,
                                      *words[at + 1:], *run], env=job_env, cwd=REPO, capture_output=True, text=True,
                                     timeout=480)
            except subprocess.TimeoutExpired:
                subprocess.run([*ray_cli, "stop", submission_id], env=job_env, timeout=60)
                raise
            seen["times"][name] = time.monotonic() - t
            status, logs = (subprocess.run([*ray_cli, verb, submission_id], env=job_env, capture_output=True,
                                           text=True, timeout=60).stdout for verb in ("status", "logs"))
            return job, status, logs

        seen["submit"], seen["job_status"], seen["job_log"] = submit("e2e", RUN)
        seen["job_args"] = parse_job_args(job_args(command) + RUN)
        seen["survivors_submit"], _, seen["survivors_log"] = submit("e2e-survivors", SURVIVORS_RUN)

        seen.update(checkpoints=[], model=None, mlflow_runs=[], collect_error=None)
        try:
            collect_results(seen, client, seen["job_args"].storage_path)
        except Exception as err:  # the tests below say what is missing
            seen["collect_error"] = repr(err)

        processes = process_tree(list(seen["pids"].values()))
        # Ray's address file, which `ray.init()` without an address follows, in each node's temp dir.
        pointers = [Path(ray_temp) / "ray_current_cluster", Path(f"{ray_temp}-worker-1") / "ray_current_cluster"]
        seen["pointers_before_down"] = [p.read_text() if p.exists() else None for p in pointers]
        t = time.monotonic()
        seen["down"] = local_sh("down", env=env, timeout=180)
        seen["times"]["down"] = time.monotonic() - t
        seen["left_running"] = running(processes)
        seen["left_pid_files"] = sorted(p.name for p in (state / "pids").glob("*.pid"))
        seen["pointers_after_down"] = [p.exists() for p in pointers]
        # The main job in the shell that exported `up`'s environment, after `down`.
        t = time.monotonic()
        seen["job_after_down"] = subprocess.run([str(VENV_BIN / "python"), str(REPO / "jobs" / "train_images.py")],
                                                env=job_env, cwd=state, capture_output=True, text=True, timeout=300)
        seen["times"]["job_after_down"] = time.monotonic() - t
        seen["times"]["total"] = time.monotonic() - started
        print("local cluster end to end, seconds:", json.dumps({k: round(v) for k, v in seen["times"].items()}))
        yield seen
    finally:
        if list((state / "pids").glob("*.pid")):
            local_sh("down", env=env, timeout=180)
        for directory in (ray_temp, f"{ray_temp}-worker-1"):
            shutil.rmtree(directory, ignore_errors=True)


def collect_results(seen: dict, client: dict[str, str], storage_path: str) -> None:
    """The runs' checkpoints and the exported model on S3, and the MLflow run, into ``seen``."""
    import pyarrow.fs as pafs
    from mlflow.tracking import MlflowClient

    from ray_resilient import list_checkpoints

    scheme, endpoint = client["AWS_ENDPOINT_URL"].split("://")
    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme=scheme, access_key=client["AWS_ACCESS_KEY_ID"],
                           secret_key=client["AWS_SECRET_ACCESS_KEY"], region=client["AWS_REGION"])
    run_dir = storage_path.removeprefix("s3://") + "/e2e"
    seen["checkpoints"] = list_checkpoints(fs, run_dir)
    seen["survivors_checkpoints"] = list_checkpoints(fs, run_dir + "-survivors")
    seen["model"] = fs.get_file_info(f"{run_dir}/final_model.pt").type
    mlflow = MlflowClient(client["MLFLOW_TRACKING_URI"])
    experiment = mlflow.get_experiment_by_name("ray_resilient")
    if experiment:
        seen["mlflow_runs"] = mlflow.search_runs([experiment.experiment_id], "tags.`ray_resilient.run` = 'e2e'")


@pytest.mark.slow
def test_local_cluster_comes_up_with_the_documented_environment(local_cluster_run):
    seen = local_cluster_run
    client = seen["client_env"]
    assert client["RAY_AUTH_MODE"] == "token"
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", client["RAY_ADDRESS"])
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", client["MLFLOW_TRACKING_URI"])
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", client["AWS_ENDPOINT_URL"])
    assert client["AWS_ACCESS_KEY_ID"] and client["AWS_SECRET_ACCESS_KEY"] and client["AWS_REGION"]
    assert seen["env_file"].splitlines() == seen["exports"]
    stripped = lambda text: "\n".join(line.strip() for line in text.strip().splitlines())  # noqa: E731
    assert stripped(seen["example"]) in stripped(seen["up"]), "`up` does not print the example job"
    assert sorted(seen["pids"]) == ["head", "mlflow", "s3", "worker-1"]
    status = seen["status"]
    assert status.returncode == 0, status.stdout + status.stderr
    assert "worker-1: running" in status.stdout and "Active:" in status.stdout


@pytest.mark.slow
def test_the_submitted_job_succeeds(local_cluster_run):
    seen = local_cluster_run
    job = seen["submit"]
    assert job.returncode == 0, (job.stdout + job.stderr)[-8000:]
    assert re.search(r"Job '[^']+' succeeded", seen["job_status"]), seen["job_status"]
    assert "RESULT " in seen["job_log"]


@pytest.mark.slow
def test_the_job_recovered_from_the_killed_worker(local_cluster_run):
    log = local_cluster_run["job_log"]
    assert "Injecting fault kill-durable-10-rank1" in log
    attempts = {int(n) for n in re.findall(r"\[attempt (\d+)\]", log)}
    assert len(attempts) >= 2, f"one attempt only: {sorted(attempts)}"
    restore_lines = [line for line in log.splitlines() if re.search(r"Resuming|Restored|Skipping|lease|\[attempt", line)]
    assert re.search(r"Resuming at step 10\b", log), ("the second attempt did not resume from checkpoint 10",
                                                     restore_lines[-20:])


@pytest.mark.slow
def test_the_submitted_job_in_survivor_mode_trains_through_its_kill_in_one_worker_group(local_cluster_run):
    seen = local_cluster_run
    job, log = seen["survivors_submit"], seen["survivors_log"]
    assert job.returncode == 0, (job.stdout + job.stderr)[-8000:]
    assert "Injecting fault kill-step-5-rank1" in log
    assert log.count("[survivors] ") == 1, "the worker group started again"  # its lead prints it at the start
    complete = [c for c in seen["survivors_checkpoints"] if c.complete]
    assert complete and complete[-1].step == (CLASSES * PER_CLASS) // 8, (seen["survivors_checkpoints"],
                                                                           seen["collect_error"])


@pytest.mark.slow
def test_the_job_numbers_its_attempts(local_cluster_run):
    log = local_cluster_run["job_log"]
    lines = sorted(set(re.findall(r"\[attempt \d+\].*", log)))
    # The job numbers attempts from its goodput ledger; on S3 a process's events reach the ledger
    # only when its spool is uploaded (every 10 s), so a count read at the restore can miss this
    # attempt's own start: "[attempt 0] ... restarts so far: -1".
    numbered = "[attempt 1]" in log and "[attempt 2]" in log
    assert numbered, f"the attempt lines of the job: {lines}"


@pytest.mark.slow
def test_a_complete_checkpoint_and_the_model_are_on_s3(local_cluster_run):
    import pyarrow.fs as pafs

    seen = local_cluster_run
    complete = [c for c in seen["checkpoints"] if c.complete]
    assert complete, (seen["checkpoints"], seen["collect_error"])
    assert complete[-1].step == 3 * ((CLASSES * PER_CLASS) // 8)
    assert seen["model"] == pafs.FileType.File


@pytest.mark.slow
def test_mlflow_has_the_runs_metrics_and_accuracy_above_chance(local_cluster_run):
    runs, error = local_cluster_run["mlflow_runs"], local_cluster_run["collect_error"]
    assert len(runs) == 1, f"MLflow runs tagged ray_resilient.run=e2e: {len(runs)} ({error})"
    metrics = runs[0].data.metrics
    for name in ("data/fetch_seconds", "goodput/goodput", "val_accuracy", "loss"):
        assert name in metrics, f"{name} not in {sorted(metrics)}"
    assert metrics["val_accuracy"] > 1 / CLASSES + 0.2
    assert 0 < metrics["goodput/goodput"] <= 1


@pytest.mark.slow
def test_down_stops_everything_up_started(local_cluster_run):
    seen = local_cluster_run
    assert seen["down"].returncode == 0, seen["down"].stdout + seen["down"].stderr
    for name in ("head", "worker-1", "mlflow", "s3"):
        assert f"stopped {name}" in seen["down"].stdout
    assert not seen["left_running"], f"still running after down: {sorted(seen['left_running'])}"
    assert not seen["left_pid_files"]


@pytest.mark.slow
def test_down_leaves_no_pointer_to_the_stopped_cluster_and_a_job_sent_there_fails_in_seconds(local_cluster_run):
    seen = local_cluster_run
    exported = seen["client_env"]["RAY_ADDRESS"]
    head_pointer = seen["pointers_before_down"][0]
    assert head_pointer is not None and head_pointer.endswith(f":{seen['ray_port']}")  # `up` left one
    assert seen["pointers_after_down"] == [False, False]
    job = seen["job_after_down"]
    assert job.returncode != 0 and seen["times"]["job_after_down"] < 60
    assert f"no Ray cluster answers at {exported}" in job.stderr, job.stderr[-3000:]
    assert "unset RAY_ADDRESS and leave out --ray-address" in job.stderr
