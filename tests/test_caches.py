"""Every cache vmcgrad defines follows one policy (:mod:`vmcgrad._cache`): bounded, and keeping no
user function (nor what it closes over) alive.

The caches are found, not listed: every module of the package is imported (``vmcgrad.netket`` and
``vmcgrad.cli`` included) and searched for module-level caches:

- instances of the policy's class, :class:`vmcgrad._cache.Cache`;
- ``functools.lru_cache``/``functools.cache`` wrappers, at module level or in a class of the module;
- dicts, ordered dicts and sets defined at module level that start empty (run-time state: a memo)
  or whose name says "cache".

A found cache must be a registered :class:`~vmcgrad._cache.Cache` with a finite bound. Then every
cache is filled past its bound with closures that are watched by weak references, and the real
routes (``chunk_size="auto"`` included) are run with closures over a large array.
"""

import ast
import collections
import gc
import importlib
import importlib.util
import inspect
import pkgutil
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np

import vmcgrad

try:  # the policy module (absent before it existed: the walker then reports every cache)
    from vmcgrad._cache import Cache, registry
except ImportError:  # pragma: no cover
    Cache, registry = None, lambda: ()

#: Module-level containers that start empty but are not memos, with why (not caches: they are not
#: keyed by user input, and they shrink by themselves).
NOT_CACHES = {
    "vmcgrad.cli._output._TEMPORARIES": "temporary files to delete at exit; each is removed once renamed",
    "vmcgrad._sr.ntk.dense.KEPT_JACOBIAN_PROGRAMS": "a registry of programs, filled once at import "
    "(minsr's update): it never grows with calls",
}

_CONTAINERS = (dict, set, collections.OrderedDict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)


def package_modules() -> list:
    """vmcgrad and every module under it (``__main__`` left out: importing it is harmless, but it
    defines nothing)."""
    names = [i.name for i in pkgutil.walk_packages(vmcgrad.__path__, "vmcgrad.")]
    return [vmcgrad] + [importlib.import_module(n) for n in names if not n.endswith("__main__")]


def _starts_empty(module) -> set:
    """Names assigned at module level to an empty dict/set/OrderedDict/... literal or call."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        empty = (isinstance(value, ast.Dict) and not value.keys) or (
            isinstance(value, ast.Call) and not value.args and not value.keywords
        )
        if empty:
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _is_lru(obj) -> bool:
    return callable(obj) and hasattr(obj, "cache_info") and hasattr(obj, "cache_clear")


def find_caches(modules) -> dict:
    """``{qualified name: object}`` of every module-level cache of ``modules`` (module docstring)."""
    found, seen = {}, set()

    def add(name, obj):
        if id(obj) not in seen:
            seen.add(id(obj))
            found[name] = obj

    for module in modules:
        empty = _starts_empty(module)
        for name, obj in vars(module).items():
            where = f"{module.__name__}.{name}"
            if Cache is not None and isinstance(obj, Cache):
                add(where, obj)
            elif _is_lru(obj) and getattr(obj, "__module__", None) == module.__name__:
                add(where, obj)
            elif isinstance(obj, _CONTAINERS) and (name in empty or "cache" in name.lower()):
                if where not in NOT_CACHES:
                    add(where, obj)
            elif isinstance(obj, type) and obj.__module__ == module.__name__:
                for attr, member in vars(obj).items():
                    if _is_lru(member) or (Cache is not None and isinstance(member, Cache)):
                        add(f"{where}.{attr}", member)
    return found


def policy_violations(caches: dict) -> list[str]:
    """What keeps each cache from the one policy (empty when all follow it)."""
    out = []
    registered = {id(c) for c in registry()}
    for name, obj in caches.items():
        if Cache is None or not isinstance(obj, Cache):
            bound = obj.cache_parameters()["maxsize"] if _is_lru(obj) else None
            out.append(f"{name}: a {type(obj).__name__} (bound {bound}), not a vmcgrad._cache.Cache")
            continue
        if not isinstance(obj.maxsize, int) or obj.maxsize < 0:
            out.append(f"{name}: unbounded (maxsize={obj.maxsize!r})")
        if id(obj) not in registered:
            out.append(f"{name}: a Cache not in vmcgrad._cache.registry()")
    return out


def test_every_cache_is_bounded_and_registered(capsys):
    caches = find_caches(package_modules())
    assert policy_violations(caches) == []
    # the registry holds nothing the walk did not find (no cache hidden from this test)
    assert {id(c) for c in registry()} == {id(c) for c in caches.values()}
    with capsys.disabled():
        print(f"\n{len(caches)} caches:", ", ".join(f"{n} ({c.maxsize})" for n, c in caches.items()))


def test_the_walker_flags_planted_caches(tmp_path, monkeypatch):
    """The detector can fail: a planted module with four unbounded or foreign caches, and a planted
    attribute on a real module, are all found and all reported."""
    source = (
        "import collections, functools\n"
        "_memo = {}\n"
        "_SEEN: set = set()\n"
        "_ORDERED = collections.OrderedDict()\n"
        "TABLE = {'a': 1}  # a constant table: not a cache\n"
        "@functools.lru_cache(maxsize=None)\n"
        "def remembered(x):\n"
        "    return x\n"
        "class Holder:\n"
        "    @functools.lru_cache(maxsize=8)\n"
        "    def method(self):\n"
        "        return 1\n"
    )
    path = tmp_path / "planted_caches.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("vmcgrad_planted_caches", path)
    planted = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, planted)
    spec.loader.exec_module(planted)
    found = find_caches([planted])
    assert sorted(found) == sorted(
        f"vmcgrad_planted_caches.{n}" for n in ("_memo", "_SEEN", "_ORDERED", "remembered", "Holder.method")
    )
    assert len(policy_violations(found)) == 5

    from vmcgrad._chunks import budget as _auto_chunk

    monkeypatch.setattr(_auto_chunk, "_planted_cache", {}, raising=False)
    problems = policy_violations(find_caches([_auto_chunk]))
    assert any("budget._planted_cache: a dict" in p for p in problems), problems
    if Cache is not None:
        unbounded = Cache(maxsize=4)
        unbounded.maxsize = None
        monkeypatch.setattr(_auto_chunk, "_planted_unbounded", unbounded, raising=False)
        problems = policy_violations(find_caches([_auto_chunk]))
        assert any("_planted_unbounded: unbounded" in p for p in problems), problems
        assert any("_planted_unbounded: a Cache not in" in p for p in problems), problems


class _Closed:
    """Something a closure holds, watched by a weak reference."""


def _holders(caches: dict, targets: list) -> list[str]:
    """The caches from which one of ``targets`` is reachable (gc referents, breadth first)."""
    ids = {id(t) for t in targets}
    globals_ = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}  # not followed
    out = []
    for name, cache in caches.items():
        stack, seen = [cache], set()
        while stack:
            obj = stack.pop()
            if id(obj) in seen or id(obj) in globals_ or isinstance(obj, type) or inspect.ismodule(obj):
                continue
            seen.add(id(obj))
            if id(obj) in ids:
                out.append(name)
                break
            stack.extend(gc.get_referents(obj))
    return out


def test_every_cache_forgets_a_dead_function_and_stays_within_its_bound():
    """Each cache, filled through its own key past its bound with live closures, keeps at most its
    bound; once the closures are dropped nothing of theirs is alive, and the next insertion into
    the full cache drops the entries of the dead ones (not a live one)."""
    caches = find_caches(package_modules())
    assert Cache is not None and all(isinstance(c, Cache) for c in caches.values())
    for name, cache in caches.items():
        saved = cache.snapshot()
        try:
            cache.clear()
            funs, refs = [], []
            for i in range(cache.maxsize + 3):
                held = _Closed()
                refs.append(weakref.ref(held))
                funs.append(lambda x, held=held: x)
                cache[cache.key(funs[-1], i)] = i
                del held
            assert len(cache) == cache.maxsize, name
            del funs
            gc.collect()
            alive = sum(r() is not None for r in refs)
            assert alive == 0, f"{name}: {alive} of {len(refs)} closures alive"
            cache[cache.key(_closure_routes, "live")] = 0  # a module-level function: alive
            assert len(cache) == 1, f"{name}: {len(cache) - 1} entries of dead functions kept"
        finally:
            cache.restore(saved)


def _closure_routes(big) -> dict:
    """Public entry points, each given fresh closures over ``big``: a weak reference to each."""
    w, x = jnp.ones(3) / 4, jnp.arange(24.0).reshape(8, 3) / 24
    ct, budget = jnp.linspace(-1.0, 1.0, 8), 2**24

    def plain(held):
        return lambda p, s: jnp.tanh(s @ p) + held.big[0]

    def partial(held):  # a pytree callable: its function in the treedef, an array leaf traced
        return jax.tree_util.Partial(lambda b, p, s: jnp.tanh(s @ p) + held.big[0] + b, jnp.zeros(()))

    routes = {
        "batched_vjp auto": lambda f: vmcgrad.batched_vjp(
            f, w, x, ct, chunk_size="auto", memory_budget=budget
        ),
        "expect_grad auto": lambda f: vmcgrad.expect_grad(
            f, w, x, ct, chunk_size="auto", memory_budget=budget
        ),
        "auto_chunk_size": lambda f: vmcgrad.auto_chunk_size(f, w, x, memory_budget=budget),
        "QGT auto": lambda f: vmcgrad.QGT(f, w, x, chunk_size="auto", memory_budget=budget) @ w,
        "batched_vjp 4": lambda f: vmcgrad.batched_vjp(f, w, x, ct, chunk_size=4),
    }
    refs = {}
    for name, run in routes.items():
        for make in (plain, partial):
            held = _Closed()
            held.big = big
            jax.block_until_ready(run(make(held)))
            refs.setdefault(name, []).append(weakref.ref(held))
            del held
    return refs


def test_no_route_keeps_a_closure_alive():
    """batched_vjp, expect_grad and QGT with ``chunk_size="auto"``, auto_chunk_size and a fixed chunk,
    each with closures over a 1 MiB array (plain functions and a ``Partial``): after
    ``jax.clear_caches()`` (jax.jit's own caches hold the functions of compiled programs) and a
    collection, no closure is alive, and no cache of vmcgrad reaches one."""
    caches = find_caches(package_modules())
    for cache in caches.values():  # caches: emptying one changes no result
        (cache.cache_clear if _is_lru(cache) else cache.clear)()
    refs = _closure_routes(np.zeros(2**17))
    filled = [n for n, c in caches.items() if not _is_lru(c) and len(c)]
    jax.clear_caches()
    gc.collect()
    alive = {name: sum(r() is not None for r in rs) for name, rs in refs.items()}
    targets = [r() for rs in refs.values() for r in rs if r() is not None]
    assert alive == dict.fromkeys(refs, 0), (alive, "held by", _holders(caches, targets))
    assert len(filled) >= 3, f"the routes filled only {filled}: the test would prove little"


def test_netket_log_psi_compiles_once_and_keeps_no_model_alive():
    """vmcgrad.netket's ``log_psi`` (no cache of its own): a ``HashablePartial`` made anew at every
    call, as the QGT's ``mode='real'`` makes one, is traced once; once the model is dropped and
    jax's caches cleared, nothing of it is alive."""
    from netket.utils import HashablePartial

    from vmcgrad.netket import _qgt
    from vmcgrad.netket._expect_grad import log_psi

    w, x = jnp.ones(3) / 4, jnp.arange(24.0).reshape(8, 3) / 24
    held, traces = _Closed(), []
    held.big = np.zeros(2**17)

    def apply_fun(variables, s, held=held):
        traces.append(1)
        return jnp.tanh(s @ variables["params"]) + held.big[0]

    counts = []
    for _ in range(3):
        fun = log_psi(HashablePartial(_qgt._real_apply, apply_fun), {})
        jax.block_until_ready(vmcgrad.batched_vjp(fun, w, x, jnp.ones(8), chunk_size="auto"))
        counts.append(len(traces))
    assert counts[0] > 0 and counts[1:] == counts[:1] * 2, f"traced again: {counts}"
    ref = weakref.ref(held)
    del held, apply_fun, fun
    jax.clear_caches()
    gc.collect()
    assert ref() is None, ("the model is alive, held by", _holders(find_caches(package_modules()), [ref()]))


def test_cache_key_keys_as_the_compiled_programs_do_without_holding():
    """``cache_key`` is equal where the static part of the function is (a fresh bound method of the
    same instance, a new ``Partial`` of the same function with other array values), differs for
    another function, accepts what is not a callable (validation reports it later), and is the
    same for a function and for its static part; a key whose function died equals only itself."""
    from vmcgrad._function import cache_key, is_dead, split_fun

    class Model:
        def apply(self, p, x):
            return x @ p

    model, f, g = Model(), (lambda p, x: x @ p), (lambda p, x: x @ p)
    assert cache_key(model.apply) == cache_key(model.apply)
    assert cache_key(model.apply) != cache_key(Model().apply)
    assert cache_key(f) == cache_key(split_fun(f)[0]) and cache_key(f) != cache_key(g)
    part = jax.tree_util.Partial(f, jnp.ones(3))
    assert cache_key(part) == cache_key(jax.tree_util.Partial(f, jnp.zeros(3)))
    assert (
        cache_key(part) == cache_key(split_fun(part)[0]) != cache_key(jax.tree_util.Partial(g, jnp.ones(3)))
    )
    assert cache_key(None) == cache_key(None) and cache_key(3) != cache_key(4)
    key, method_key, part_key = cache_key(f), cache_key(model.apply), cache_key(part)
    del f, part, model
    gc.collect()
    assert is_dead(key) and is_dead(method_key) and key == key and key != cache_key(g)
    assert is_dead(part_key) and part_key == part_key and not is_dead(cache_key(g))
