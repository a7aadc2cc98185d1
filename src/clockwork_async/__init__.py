"""clockwork-async: a model-serving daemon (Clockwork, OSDI'20), its controller core and simulator.

Importing the package first checks that no compiled (mypyc) module is older than its source
(`clockwork_async.build`): a stale one is never used.
"""

from clockwork_async.build import guard_stale_modules as _guard_stale_modules

_guard_stale_modules()
