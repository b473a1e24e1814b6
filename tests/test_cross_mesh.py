"""Cross-mesh scheduling (formulations.cross_mesh): problem validation, schedule semantics
(full duplex, tails), feasibility of every algorithm, CP-SAT against heuristics, the lower
bound and brute force on tiny random instances."""

from __future__ import annotations

import math
import random

import pytest

from formulations.cross_mesh import (
    ALGORITHMS,
    Candidate,
    CrossMeshProblem,
    SchedTask,
    ScheduledTask,
    SchedulerOptions,
    Status,
    brute_force,
    cpsat,
    dfs,
    in_order_greedy,
    load_balance,
    naive,
    randomized_greedy,
    simulate,
    solve_all,
)
from ilp_planner.errors import ConfigError, InfeasibleError
from tests.helpers.oracles import validate_schedule

HEURISTICS = {
    "naive": naive,
    "load_balance": load_balance,
    "in_order_greedy": in_order_greedy,
    "randomized_greedy": lambda p: randomized_greedy(p, seed=1, restarts=2, samples=4),
    "dfs": lambda p: dfs(p, budget_s=0.5),
}


def task(name: str, receivers: tuple[int, ...], *cands: tuple[int, float], tail: float = 0.0
         ) -> SchedTask:
    return SchedTask(name, receivers, tuple(Candidate(s, d, tail) for s, d in cands))


def random_problem(seed: int, n: int, senders: int = 3, receivers: int = 3) -> CrossMeshProblem:
    """Hosts 0..senders-1 send, the next ``receivers`` hosts receive; 1–2 sender candidates
    with sender-dependent durations, 1–2 receiving hosts, small random tails."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        cands = sorted(rng.sample(range(senders), rng.randint(1, 2)))
        recv = sorted(rng.sample(range(senders, senders + receivers), rng.randint(1, 2)))
        base = rng.choice([1.0, 2.0, 3.0, 5.0])
        tasks.append(SchedTask(f"t{i}", tuple(recv), tuple(
            Candidate(s, base * rng.uniform(0.9, 1.3), rng.choice([0.0, 0.1, 0.4]))
            for s in cands)))
    return CrossMeshProblem(tuple(tasks), senders + receivers)


# -- problem data ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tasks, hosts, match",
    [
        ((SchedTask("a", (1,), ()),), 2, "no sender candidate"),
        ((SchedTask("a", (), (Candidate(0, 1.0),)),), 2, "no receiving host"),
        ((task("a", (5,), (0, 1.0)),), 2, "host 5 outside"),
        ((task("a", (1,), (0, 1.0), (0, 2.0)),), 2, "sender host listed twice"),
        ((task("a", (1,), (0, -1.0)),), 2, "must be finite and >= 0"),
        ((task("a", (1,), (0, 1.0)), task("a", (1,), (0, 1.0))), 2, "duplicate task name"),
    ],
)
def test_problem_validation_names_the_task(tasks, hosts, match) -> None:
    with pytest.raises(ConfigError, match=match):
        CrossMeshProblem(tasks, hosts)


def test_unknown_algorithm_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown scheduling algorithm"):
        SchedulerOptions(algorithms=("cpsat", "simulated_annealing"))


# -- semantics -----------------------------------------------------------------------------------


def test_full_duplex_send_and_receive_overlap() -> None:
    # h0 -> h1 and h1 -> h0 at once: different sides of each host, no conflict.
    p = CrossMeshProblem((task("a", (1,), (0, 2.0)), task("b", (0,), (1, 3.0))), 2)
    sched, mk = simulate(p, [0, 0], [0, 1])
    assert mk == 3.0 and sched[1].start == 0.0
    assert cpsat(p, time_limit_s=1, num_workers=1).makespan == pytest.approx(3.0)


def test_shared_receiver_or_sender_serialises() -> None:
    shared_recv = CrossMeshProblem((task("a", (2,), (0, 2.0)), task("b", (2,), (1, 3.0))), 3)
    shared_send = CrossMeshProblem((task("a", (1,), (0, 2.0)), task("b", (2,), (0, 3.0))), 3)
    for p in (shared_recv, shared_send):
        sched, mk = simulate(p, [0, 0], [0, 1])
        assert mk == 5.0 and sched[1].start == 2.0
        assert p.lower_bound() == 5.0


def test_tail_holds_no_resource_but_counts_in_makespan() -> None:
    p = CrossMeshProblem((task("a", (2,), (0, 2.0), tail=1.5),
                          task("b", (2,), (1, 2.0), tail=0.5)), 3)
    # Best: a first (its tail overlaps b's NIC time), makespan max(2 + 1.5, 4 + 0.5) = 4.5.
    assert brute_force(p).makespan == pytest.approx(4.5)
    assert cpsat(p, time_limit_s=1, num_workers=1).makespan == pytest.approx(4.5)
    assert p.lower_bound() == pytest.approx(4.5)  # receive load 4 + smallest tail 0.5


def test_sender_choice_balances_the_case_2_pattern() -> None:
    # Zhuang et al. case 2: one slice replicated on both source hosts, two destination hosts.
    p = CrossMeshProblem((task("a", (2,), (0, 1.0), (1, 1.0)),
                          task("b", (3,), (0, 1.0), (1, 1.0))), 4)
    assert naive(p).makespan == 2.0  # both from host 0
    for name in ("load_balance", "randomized_greedy", "dfs"):
        assert HEURISTICS[name](p).makespan == 1.0, name
    assert cpsat(p, time_limit_s=1, num_workers=1).makespan == 1.0


def test_order_matters_in_the_case_3_pattern() -> None:
    # Case 3/9: each source host holds one half, each destination host needs both halves.
    p = CrossMeshProblem(tuple(task(f"d{d}s{s}", (2 + d,), (s, 1.0))
                               for d in range(2) for s in range(2)), 4)
    assert naive(p).makespan == 3.0  # dst-major order: both senders hit host 2 first
    best = cpsat(p, time_limit_s=1, num_workers=1)
    assert best.makespan == 2.0 == p.lower_bound() and best.status is Status.OPTIMAL


def test_validate_schedule_reports_overlap_and_wrong_sender() -> None:
    p = CrossMeshProblem((task("a", (2,), (0, 2.0)), task("b", (2,), (1, 3.0))), 3)
    bad = (ScheduledTask(0, 0, 0, 0.0, 2.0, 2.0), ScheduledTask(1, 0, 1, 1.0, 4.0, 4.0))
    errors = validate_schedule(p, bad)
    assert len(errors) == 1 and "host 2 receive side" in errors[0]
    wrong = (ScheduledTask(0, 0, 1, 0.0, 2.0, 2.0), ScheduledTask(1, 0, 1, 2.0, 5.0, 5.0))
    assert any("not candidate" in e for e in validate_schedule(p, wrong))
    with pytest.raises(InfeasibleError, match="not a permutation"):
        simulate(p, [0, 0], [0, 0])


def test_brute_force_refuses_large_instances() -> None:
    with pytest.raises(ConfigError, match="limited to 7 tasks"):
        brute_force(random_problem(0, 8))


# -- algorithms against each other ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(24))
def test_tiny_instances_cpsat_and_dfs_equal_brute_force(seed: int) -> None:
    p = random_problem(seed, n=3 + seed % 3)
    exact = brute_force(p)
    lb = p.lower_bound()
    assert lb <= exact.makespan * (1 + 1e-9)
    sat = cpsat(p, time_limit_s=5, num_workers=1, seed=0)
    assert sat.makespan == pytest.approx(exact.makespan, rel=1e-6)
    assert sat.status is Status.OPTIMAL
    full = dfs(p, budget_s=30)
    assert full.makespan == pytest.approx(exact.makespan, rel=1e-9)
    assert full.status is Status.OPTIMAL
    for name, algo in HEURISTICS.items():
        r = algo(p)
        assert validate_schedule(p, r.schedule) == [], name
        assert r.makespan >= exact.makespan * (1 - 1e-9), name
    for r in (exact, sat, full):
        assert validate_schedule(p, r.schedule) == []


@pytest.mark.parametrize("seed", range(4))
def test_cpsat_never_worse_than_heuristics_and_above_bound(seed: int) -> None:
    p = random_problem(100 + seed, n=18, senders=3, receivers=4)
    results = solve_all(p, SchedulerOptions(time_limit_s=2, num_workers=2, seed=0,
                                            dfs_budget_s=0.3, greedy_restarts=2))
    sat = results["cpsat"]
    lb = p.lower_bound()
    for r in results.values():
        assert validate_schedule(p, r.schedule) == [], r.algorithm
        assert r.makespan >= lb * (1 - 1e-9), r.algorithm
        assert r.lower_bound == lb
        assert sat.makespan <= r.makespan * (1 + 1e-12), r.algorithm
    for name in ("naive", "load_balance", "in_order_greedy"):
        assert sat.makespan <= HEURISTICS[name](p).makespan
    assert {s.task for s in sat.schedule} == set(range(p.size))
    assert set(sat.assignment) == set(range(p.size))


def test_identical_tasks_symmetry_is_solved_exactly() -> None:
    # 32 interchangeable tasks per (sender, receiver) pair: CP-SAT and DFS reach the bound.
    tasks = tuple(task(f"s{s}r{r}n{k}", (2 + r,), (s, 1.0))
                  for r in range(2) for s in range(2) for k in range(16))
    p = CrossMeshProblem(tasks, 4)
    assert p.lower_bound() == 32.0
    assert dfs(p, budget_s=5).makespan == 32.0
    r = cpsat(p, time_limit_s=5, num_workers=2, hint=naive(p))
    assert r.makespan == 32.0 and r.status is Status.OPTIMAL
    assert validate_schedule(p, r.schedule) == []


def test_cpsat_model_dump(tmp_path) -> None:
    p = random_problem(7, 4)
    path = tmp_path / "model.pb.txt"
    cpsat(p, time_limit_s=1, num_workers=1, model_dump=str(path))
    text = path.read_text()
    assert "start[t0]" in text and "no_overlap" in text


def test_every_registered_algorithm_runs() -> None:
    p = random_problem(3, 5)
    res = solve_all(p, SchedulerOptions(algorithms=tuple(ALGORITHMS), time_limit_s=1,
                                        num_workers=1, dfs_budget_s=0.2))
    assert set(res) == set(ALGORITHMS)
    exact = res["brute_force"].makespan
    assert math.isclose(res["cpsat"].makespan, exact, rel_tol=1e-6)


def test_dfs_first_dive_keeps_to_the_budget_only_with_a_fallback() -> None:
    """Without a fallback the first dive runs to its end (a schedule is always returned);
    with one, a budget the dive cannot meet returns the fallback's schedule, said so."""
    p = random_problem(3, 400)
    lb = load_balance(p)
    whole = dfs(p, budget_s=1e-9)
    assert whole.algorithm == "dfs" and validate_schedule(p, whole.schedule) == []
    cut = dfs(p, budget_s=1e-9, fallback=lb)
    assert cut.algorithm == "dfs" and "first dive stopped" in cut.note
    assert (cut.makespan, cut.schedule, cut.status) == (lb.makespan, lb.schedule, lb.status)
    small = random_problem(3, 8)  # a search within its budget is unaffected
    plain, given = dfs(small, budget_s=30), dfs(small, budget_s=30, fallback=load_balance(small))
    assert plain.status is Status.OPTIMAL
    assert (given.makespan, given.schedule, given.status) == (plain.makespan, plain.schedule,
                                                              plain.status)
