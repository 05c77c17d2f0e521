"""Every collective call site in hf_fsdp2/ is vouched for: reached by an audited test, or given a reason.

The sites are read from the source (tests/collective_sites.py); a new one fails here until MANIFEST names it, so a
collective added without a test that runs it under the device audit (tests/collective_audit.py) does not slip in.
That "reached" sites are reached is checked at the end of a whole-suite run (tests/conftest.py); the last test here
shows the record that check reads.
"""

from __future__ import annotations

import textwrap

from tests import collective_sites
from tests.collective_sites import MANIFEST, REACHED, find_sites, recorded_lines, sites_on
from tests.launch import run

ADVICE = (
    "add it to MANIFEST in tests/collective_sites.py: 'reached' when an audited multi-rank test makes the call "
    "(write one: tests/workers/*, through tests/launch.py), else a one-line reason"
)


def test_every_collective_site_in_the_package_is_in_the_manifest():
    new = sorted({site.id for site in find_sites()} - set(MANIFEST))
    assert new == [], f"collective site(s) without a verdict: {new}; {ADVICE}"


def test_the_manifest_names_no_site_that_is_gone():
    assert sorted(set(MANIFEST) - {site.id for site in find_sites()}) == []


def test_each_verdict_is_reached_or_a_one_line_reason():
    assert [site for site, verdict in MANIFEST.items() if not verdict.strip() or "\n" in verdict] == []
    assert sum(verdict == REACHED for verdict in MANIFEST.values()) > len(MANIFEST) // 2


def test_the_finder_names_each_kind_of_site_stably(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        textwrap.dedent(
            """
            import functools
            import torch.distributed as dist
            import torch.distributed._functional_collectives as funcol
            import torch.distributed.checkpoint as dcp
            from torch.distributed.nn.functional import all_to_all_single
            from torch.distributed.tensor import distribute_tensor

            class Box:
                def sum(self, t, group):
                    dist.all_reduce(t, group=group)
                    dist.all_reduce(
                        t,
                        group=group,
                    )
                    return funcol.all_gather_tensor(t, 0, group).full_tensor()

            def save(state, unit):
                unit.unshard()
                dist.get_rank()  # not a collective
                run = functools.partial(dcp.save, state)
                return all_to_all_single(state, state), distribute_tensor(state, None, None), run
            """
        )
    )
    sites = find_sites(str(package))
    assert [(s.id, s.first, s.last) for s in sites] == [
        ("pkg/mod.py::Box.sum::all_reduce", 11, 11),
        ("pkg/mod.py::Box.sum::all_reduce#2", 12, 15),
        ("pkg/mod.py::Box.sum::full_tensor", 16, 16),
        ("pkg/mod.py::Box.sum::all_gather_tensor", 16, 16),
        ("pkg/mod.py::save::unshard", 19, 19),
        ("pkg/mod.py::save::save", 21, 21),
        ("pkg/mod.py::save::all_to_all_single", 22, 22),
        ("pkg/mod.py::save::distribute_tensor", 22, 22),
    ]
    assert sites_on(sites, [("pkg/mod.py", 14), ("pkg/mod.py", 19), ("pkg/other.py", 11)]) == {
        "pkg/mod.py::Box.sum::all_reduce#2",
        "pkg/mod.py::save::unshard",
    }


def test_an_audited_launch_records_the_package_lines_its_collectives_came_from(tmp_path, monkeypatch):
    monkeypatch.setenv(collective_sites.REACHED_DIR, str(tmp_path))
    run("planted_collectives_worker.py", 2, "allowed")
    reached = sites_on(find_sites(), recorded_lines(str(tmp_path)))
    assert "hf_fsdp2/distributed.py::first_on_any_rank::all_gather_object" in reached
    assert len(list(tmp_path.iterdir())) == 2  # one file per rank
