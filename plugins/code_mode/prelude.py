"""The JavaScript installed in every Code Mode V8 context.

It is a function of ``ring`` (a one-way doorbell to the host, the only host object the
context ever holds) and the limits. It removes what the context does not need
(``setTimeout``, ``Atomics``, ``WebAssembly``, ``eval``-like escapes of the glue stay
closed over) and defines three frozen, non-writable globals the host calls by
evaluating short expressions:

* ``__loopstack_run(body, toolNames)``: compile ``body`` as an async function of
  ``tools, console, store, load`` and start it; returns what its synchronous part queued
  (as ``__loopstack_drain`` does). Each ``tools.<name>(args)`` queues a ``call`` message
  and returns a promise; the end of the program queues ``done``. Messages queued later
  (in promise continuations) ring the doorbell.
* ``__loopstack_drain()``: the queued messages, as one JSON array (then empties it).
* ``__loopstack_settle(id, ok, text)``: resolve (``ok``, value parsed from JSON when
  it is JSON) or reject (``ToolError``) the promise of call ``id``.

The host never calls into the context synchronously: every call is a cancelable
evaluation, so a program that loops forever cannot block the harness (see sandbox.py).
The glue captures ``JSON`` and the other builtins it uses at install time, so a
program that overwrites them breaks only itself.
"""

from __future__ import annotations

PRELUDE = r"""
(ring, maxLogChars) => {
  "use strict";
  const stringify = JSON.stringify, parse = JSON.parse, freeze = Object.freeze;
  const define = Object.defineProperty, hasOwn = Object.prototype.hasOwnProperty;
  const AsyncFunction = (async () => {}).constructor;
  const outbox = [];
  const pending = new Map();
  const stored = new Map();
  let nextId = 0, logs = [], logChars = 0, logsDropped = 0, isRunning = false, isInHostCall = false;

  for (const name of ["setTimeout", "clearTimeout", "__timer_manager", "Atomics", "WebAssembly", "SharedArrayBuffer"]) {
    try { delete globalThis[name]; } catch (_) { /* a var: not configurable (strict mode throws) */ }
    try { if (name in globalThis) globalThis[name] = undefined; } catch (_) { /* read-only: leave it */ }
  }

  // inside __loopstack_run the host reads the queue from its return value: no ring needed
  const send = (message) => { outbox.push(stringify(message)); if (!isInHostCall) ring(); };

  const text = (value) => {
    if (typeof value === "string") return value;
    try { const out = stringify(value); return out === undefined ? String(value) : out; }
    catch (_) { try { return String(value); } catch (_) { return "[unprintable]"; } }
  };

  const describe = (error) => {
    try {
      if (error !== null && typeof error === "object" && typeof error.stack === "string") return error.stack;
      return "Uncaught " + text(error);
    } catch (_) { return "Uncaught [unprintable error]"; }
  };

  const logger = (level) => (...args) => {
    const line = (level ? "[" + level + "] " : "") + args.map(text).join(" ");
    if (logChars + line.length > maxLogChars) { logsDropped++; return; }
    logs.push(line);
    logChars += line.length + 1;
  };
  const console = freeze({
    log: logger(""), info: logger("info"), debug: logger("debug"), warn: logger("warn"), error: logger("error"),
  });

  const call = (name, args) => new Promise((resolve, reject) => {
    if (!isRunning) { reject(new Error("tools." + name + ": the program has already returned")); return; }
    let encoded;
    try { encoded = stringify(args === undefined ? {} : args); }
    catch (error) { reject(new TypeError("tools." + name + ": arguments are not JSON: " + error.message)); return; }
    const id = nextId++;
    pending.set(id, { resolve, reject, name });
    send({ kind: "call", id, name, args: encoded === undefined ? "null" : encoded });
  });

  const store = (key, value) => {
    const encoded = stringify(value);
    if (encoded === undefined) throw new TypeError("store(" + text(key) + "): value is not JSON");
    stored.set(String(key), encoded);
  };
  const load = (key) => {
    const encoded = stored.get(String(key));
    return encoded === undefined ? undefined : parse(encoded);
  };

  const finish = (ok, value) => {
    isRunning = false;
    let result = null, error = null;
    if (ok) {
      try { result = value === undefined ? "null" : stringify(value); if (result === undefined) result = "null"; }
      catch (caught) { ok = false; value = caught; }
    }
    if (!ok) error = describe(value);
    send({ kind: "done", ok, result, error, logs, logsDropped });
  };

  const run = (body, toolNames) => {
    isInHostCall = true;
    try { start(body, toolNames); } finally { isInHostCall = false; }
    return drain();
  };

  const start = (body, toolNames) => {
    // a session context may still hold an earlier program's queue and unsettled calls
    outbox.length = 0; pending.clear();
    logs = []; logChars = 0; logsDropped = 0; isRunning = true;
    const tools = {};
    for (const name of toolNames) tools[name] = (args) => call(name, args);
    freeze(tools);
    let program;
    try { program = new AsyncFunction("tools", "console", "store", "load", body); }
    catch (error) { finish(false, error); return; }
    let started;
    try { started = program(tools, console, store, load); }
    catch (error) { finish(false, error); return; }
    started.then((value) => finish(true, value), (error) => finish(false, error));
  };

  const settle = (id, ok, payload) => {
    const entry = pending.get(id);
    if (entry === undefined) return;
    pending.delete(id);
    if (ok) {
      let value;
      try { value = parse(payload); } catch (_) { value = payload; }
      entry.resolve(value);
    } else {
      const error = new Error(payload);
      error.name = "ToolError";
      error.tool = entry.name;
      entry.reject(error);
    }
  };

  const drain = () => { const out = "[" + outbox.join(",") + "]"; outbox.length = 0; return out; };

  for (const [name, value] of [["__loopstack_run", run], ["__loopstack_settle", settle], ["__loopstack_drain", drain]]) {
    define(globalThis, name, { value: freeze(value), writable: false, configurable: false, enumerable: false });
  }
  define(globalThis, "console", { value: console, writable: false, configurable: false, enumerable: false });
  return hasOwn.call(globalThis, "__loopstack_run");
}
"""
