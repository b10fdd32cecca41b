"""`make test`'s scheduling of test files over pytest-xdist workers, on xdist's own scheduler
with stand-in worker nodes (a real worker is a process of a pytest run)."""

from __future__ import annotations

from types import SimpleNamespace

from xdist.remote import Producer

from tests.xdist_scheduling import FileScheduling

COLLECTION = [
    "tests/test_many.py::a", "tests/test_many.py::b", "tests/test_many.py::c",
    "tests/test_short.py::a",
    "tests/kvcache/test_one.py::a", "tests/kvcache/test_two.py::a",
    "tests/cluster/test_one.py::a",
    "tests/e2e/test_deepseek_v4_mesh.py::a",
]


class StandInWorkerNode:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.units: list[list[str]] = []

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.units.append([COLLECTION[i] for i in indexes])

    def shutdown(self) -> None:
        self.shutting_down = True


def test_long_units_go_out_first_and_a_folder_unit_stays_on_one_worker() -> None:
    options = {"tx": ["popen", "popen"], "numprocesses": 2}
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True, maxworkerrestart=None),
                             getvalue=options.get)
    scheduling = FileScheduling(config, Producer("scheduling", enabled=False))
    nodes = [StandInWorkerNode("gw0"), StandInWorkerNode("gw1")]
    for node in nodes:
        scheduling.add_node(node)
        scheduling.add_node_collection(node, COLLECTION)
    scheduling.schedule()

    first_units = [node.units[0] for node in nodes]
    assert first_units == [["tests/kvcache/test_one.py::a", "tests/kvcache/test_two.py::a"],
                           ["tests/cluster/test_one.py::a"]]
    assert [node.units[1] for node in nodes] == [["tests/e2e/test_deepseek_v4_mesh.py::a"],
                                                 ["tests/test_many.py::a", "tests/test_many.py::b",
                                                  "tests/test_many.py::c"]]
    assert list(scheduling.workqueue) == ["tests/test_short.py"]
