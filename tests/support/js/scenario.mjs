// Drive a sandbox with the real E2B JavaScript SDK (npm `e2b`) and report one JSON line per check.
//
// The JS counterpart of tests/support/sdk_scenario.py: same fakes, same relay set-up
// (tests/support/sdk_matrix.py), same output protocol, same check names (the rows of README's
// table), so that the Python test compares both the same way:
//
//   {"check": <row>, "observed": "ok" | "returned <value>" | "<ErrorClass>: <message>" | "n/a: …"}
//   {"info": {...}}                 facts for debugging
//   {"event": "remove-route"}       then one line "removed" is awaited on stdin
//
// Environment: E2B_API_URL, E2B_SANDBOX_URL (fixed form), E2B_DOMAIN, E2B_API_KEY as for any user;
// SDK_JS_ROOT (the npm ci'd tests/.cache/sdk-js) and SDK_JS_PACKAGE (the alias of one release,
// e.g. e2b-2.51.0); SCENARIO_CONFIG as for the Python driver.
//
// Host form. https://49983-<id>.<domain> means port 443 while relay listens on a free port, so a
// dns.lookup preload cannot do it: the driver reaches the names through the loopback CONNECT
// proxy (tests/support/tunnel_proxy.py, in HTTPS_PROXY), by whatever the release's fetch honours.
// Undici ignores HTTPS_PROXY by itself.
// - Releases that depend on undici (2.51.0) send everything through their own undici Agent
//   (allowH2, a bounded pool), never through globalThis.fetch: their `proxy` option
//   (ConnectionOpts.proxy, an undici ProxyAgent with proxyTunnel, for API, envd REST and RPC
//   alike) is the way in.
// - Older ones (2.8.4) have no such option and call globalThis.fetch, Node's bundled undici:
//   the driver sets that fetch's global dispatcher to a ProxyAgent before loading the SDK.
// TLS is relay's, trusted through NODE_EXTRA_CA_CERTS (Node's default CA store, which both
// undici's tls.connect use). The driver's own requests (signed URLs, the app port) go through the
// same ProxyAgent, and raw net/tls for the WebSocket handshake (whose status must be seen).

import { createHash, randomBytes } from "node:crypto";
import { createRequire } from "node:module";
import net from "node:net";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import tls from "node:tls";
import { pathToFileURL } from "node:url";

const ROOT = process.env.SDK_JS_ROOT;
const PACKAGE = process.env.SDK_JS_PACKAGE;
const require = createRequire(join(ROOT, "package.json"));
const PACKAGE_DIR = dirname(require.resolve(`${PACKAGE}/package.json`));
const SDK_PACKAGE = require(`${PACKAGE}/package.json`);
const SDK_VERSION = SDK_PACKAGE.version;
const OWN_UNDICI = "undici" in (SDK_PACKAGE.dependencies ?? {});
const undici = require("undici");
const PROXY = process.env.HTTPS_PROXY || "";
const DISPATCHER = PROXY ? new undici.ProxyAgent({ uri: PROXY, proxyTunnel: true }) : undefined;
if (DISPATCHER && !OWN_UNDICI) undici.setGlobalDispatcher(DISPATCHER);
const OPTS = PROXY && OWN_UNDICI ? { proxy: PROXY } : {};
const e2b = await import(pathToFileURL(join(PACKAGE_DIR, "dist", "index.mjs")).href);
const { Sandbox, CommandExitError } = e2b;

const CONFIG = JSON.parse(process.env.SCENARIO_CONFIG || "{}");
const FORM = CONFIG.form || "direct";
const MAIN_ID = CONFIG.sandbox_id || "";
const MIB = 1024 * 1024;

class NotAvailable extends Error {}

const emit = (payload) => process.stdout.write(JSON.stringify(payload) + "\n");

function describe(err) {
  const name = err?.constructor?.name || typeof err;
  const text = String(err?.message ?? err).split(/\s+/).filter(Boolean).join(" ");
  return `${name}: ${text}`.slice(0, 400);
}

function observedValue(value) {
  return value === undefined || value === null ? "ok" : `returned ${JSON.stringify(value)}`.slice(0, 400);
}

function expect(condition, message) {
  if (!condition) throw new AssertionError(message);
}

class AssertionError extends Error {}

async function runCheck(name, check) {
  const started = performance.now();
  const report = (observed, detail = "") =>
    emit({ check: name, observed, detail: detail.slice(0, 1500), seconds: (performance.now() - started) / 1000 });
  try {
    report(observedValue(await check()));
  } catch (err) {
    if (err instanceof NotAvailable) report(`n/a: ${err.message}`);
    else report(describe(err), String(err?.stack ?? ""));
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function until(predicate, timeoutMs) {
  const deadline = performance.now() + timeoutMs;
  while (performance.now() < deadline && !predicate()) await sleep(50);
  return predicate();
}

// -- plain HTTP (what a browser or curl would do with the SDK's URLs) --------------------------------

async function request(url, { method = "GET", body, headers = {} } = {}) {
  const response = await undici.fetch(url, {
    method,
    body,
    headers,
    dispatcher: DISPATCHER,
    signal: AbortSignal.timeout(15000),
  });
  return { status: response.status, body: Buffer.from(await response.arrayBuffer()), headers: response.headers };
}

function appRequest(sbx, port, path) {
  if (FORM === "host") return [`https://${sbx.getHost(port)}${path}`, {}];
  const base = process.env.E2B_SANDBOX_URL.replace(/\/$/, "");
  return [`${base}${path}`, { "E2b-Sandbox-Id": sbx.sandboxId, "E2b-Sandbox-Port": String(port) }];
}

// A byte reader over a socket: the WebSocket check reads the head and frames exactly.
function reader(sock) {
  let buffered = Buffer.alloc(0);
  let wake = null;
  let ended = false;
  sock.on("data", (chunk) => {
    buffered = Buffer.concat([buffered, chunk]);
    wake?.();
  });
  sock.on("close", () => {
    ended = true;
    wake?.();
  });
  sock.on("error", () => {});
  // Until test() holds: woken by each read, bounded by 15 s in all (one timer per call).
  async function fill(test) {
    const deadline = performance.now() + 15000;
    while (!test()) {
      if (ended) throw new Error(`connection closed (${buffered.length} bytes buffered)`);
      const left = deadline - performance.now();
      if (left <= 0) throw new Error(`read timed out (${buffered.length} bytes buffered)`);
      let timer;
      await new Promise((resolve) => {
        wake = resolve;
        timer = setTimeout(resolve, left);
      });
      clearTimeout(timer);
    }
  }
  return {
    async exactly(count) {
      await fill(() => buffered.length >= count);
      const out = buffered.subarray(0, count);
      buffered = buffered.subarray(count);
      return out;
    },
    async head() {
      await fill(() => buffered.indexOf("\r\n\r\n") >= 0);
      const end = buffered.indexOf("\r\n\r\n") + 4;
      const text = buffered.subarray(0, end).toString("latin1");
      buffered = buffered.subarray(end);
      const lines = text.split("\r\n");
      const headers = {};
      for (const line of lines.slice(1)) {
        const at = line.indexOf(":");
        if (at > 0) headers[line.slice(0, at).trim().toLowerCase()] = line.slice(at + 1).trim();
      }
      return [Number(lines[0].split(" ")[1]), headers];
    },
  };
}

const connected = (sock, event) =>
  new Promise((resolve, reject) => {
    sock.once(event, resolve);
    sock.once("error", reject);
  });

async function openSocket(url) {
  if (url.protocol !== "https:") {
    const sock = net.connect(Number(url.port || 80), url.hostname);
    await connected(sock, "connect");
    return [sock, reader(sock)];
  }
  const proxy = new URL(PROXY);
  const raw = net.connect(Number(proxy.port), proxy.hostname);
  await connected(raw, "connect");
  const authority = `${url.hostname}:${url.port || 443}`;
  raw.write(`CONNECT ${authority} HTTP/1.1\r\nHost: ${authority}\r\n\r\n`);
  const tunnel = reader(raw);
  const [status] = await tunnel.head();
  expect(status === 200, `proxy answered CONNECT with ${status}`);
  raw.removeAllListeners("data");
  const sock = tls.connect({ socket: raw, servername: url.hostname, ALPNProtocols: ["http/1.1"] });
  await connected(sock, "secureConnect");
  return [sock, reader(sock)];
}

function wsFrame(opcode, payload) {
  const size = payload.length;
  const head = size < 126 ? Buffer.from([0x80 | opcode, 0x80 | size])
    : size < 65536 ? Buffer.from([0x80 | opcode, 0x80 | 126, size >> 8, size & 0xff])
      : Buffer.concat([Buffer.from([0x80 | opcode, 0x80 | 127]), Buffer.from(BigInt(size).toString(16).padStart(16, "0"), "hex")]);
  const mask = randomBytes(4);
  const masked = Buffer.from(payload.map((b, i) => b ^ mask[i % 4]));
  return Buffer.concat([head, mask, masked]);
}

async function wsRecv(read) {
  const [first, second] = await read.exactly(2);
  let size = second & 0x7f;
  if (size === 126) size = (await read.exactly(2)).readUInt16BE(0);
  else if (size === 127) size = Number((await read.exactly(8)).readBigUInt64BE(0));
  const mask = second & 0x80 ? await read.exactly(4) : null;
  let payload = Buffer.from(await read.exactly(size));
  if (mask) payload = Buffer.from(payload.map((b, i) => b ^ mask[i % 4]));
  return [first & 0x0f, payload];
}

async function wsHandshake(target, headers) {
  const url = new URL(target);
  const [sock, read] = await openSocket(url);
  const key = randomBytes(16).toString("base64");
  const lines = [
    `GET ${url.pathname} HTTP/1.1`,
    `Host: ${url.host}`,
    "Upgrade: websocket",
    "Connection: Upgrade",
    `Sec-WebSocket-Key: ${key}`,
    "Sec-WebSocket-Version: 13",
    ...Object.entries(headers).map(([name, value]) => `${name}: ${value}`),
  ];
  sock.write(lines.join("\r\n") + "\r\n\r\n");
  const [status, responseHeaders] = await read.head();
  if (status === 101) {
    const accept = createHash("sha1").update(key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest("base64");
    expect(responseHeaders["sec-websocket-accept"] === accept, "bad Sec-WebSocket-Accept");
  }
  return [sock, read, status];
}

// -- checks on one sandbox handle --------------------------------------------------------------------

function sandboxChecks(sbx) {
  async function runOutput() {
    await sbx.files.makeDir("/home/user/work");
    const result = await sbx.commands.run('echo "$FOO" && pwd', { envs: { FOO: "bar" }, cwd: "/home/user/work" });
    expect(result.exitCode === 0, JSON.stringify(result));
    expect(result.stdout.startsWith("bar\n"), JSON.stringify(result.stdout));
    expect(result.stdout.endsWith("/home/user/work\n"), JSON.stringify(result.stdout));
  }

  async function runFailure() {
    try {
      await sbx.commands.run("echo oops >&2; exit 3");
    } catch (err) {
      expect(err instanceof CommandExitError, describe(err));
      expect(err.exitCode === 3 && err.stderr === "oops\n", describe(err));
      return;
    }
    throw new AssertionError("no CommandExitError");
  }

  async function incremental() {
    const arrivals = [];
    const started = performance.now();
    await sbx.commands.run("for i in 1 2 3 4; do echo line$i; sleep 0.4; done", {
      onStdout: (text) => arrivals.push([(performance.now() - started) / 1000, text]),
    });
    const text = arrivals.map(([, chunk]) => chunk).join("");
    expect(text === "line1\nline2\nline3\nline4\n", JSON.stringify(text));
    expect(arrivals.length >= 3, `only ${arrivals.length} onStdout callbacks`);
    const spread = arrivals.at(-1)[0] - arrivals[0][0];
    // Four lines 0.4 s apart: streamed, the callbacks span ~1.2 s; buffered, ~0 s.
    expect(spread >= 0.8, `callbacks within ${spread.toFixed(2)}s`);
    emit({ info: { "onStdout arrivals": arrivals.map(([t]) => Math.round(t * 1000) / 1000) } });
  }

  async function backgroundConnectKill() {
    const handle = await sbx.commands.run(
      "echo started; for i in $(seq 1 300); do echo tick $i; sleep 0.1; done",
      { background: true },
    );
    const pids = (await sbx.commands.list()).map((p) => p.pid);
    expect(pids.includes(handle.pid), `${handle.pid} not in ${pids}`);
    let seen = "";
    const attached = await sbx.commands.connect(handle.pid, { onStdout: (text) => (seen += text) });
    expect(attached.pid === handle.pid, "connect returned another pid");
    expect(await until(() => seen.includes("tick"), 10000), `no output through connect(pid): ${seen}`);
    expect((await sbx.commands.kill(handle.pid)) === true, "kill returned false");
    try {
      await handle.wait();
    } catch (err) {
      expect(err instanceof CommandExitError && err.exitCode === -1, describe(err));
      return;
    }
    throw new AssertionError("killed command exited cleanly");
  }

  async function stdin() {
    const handle = await sbx.commands.run('read line; echo "got:$line"', { background: true, stdin: true });
    await sbx.commands.sendStdin(handle.pid, "hello stdin\n");
    const result = await handle.wait();
    expect(result.stdout === "got:hello stdin\n", JSON.stringify(result.stdout));
  }

  async function closeStdin() {
    if (typeof sbx.commands.closeStdin !== "function") throw new NotAvailable("no commands.closeStdin in this release");
    const handle = await sbx.commands.run("cat", { background: true, stdin: true });
    await sbx.commands.sendStdin(handle.pid, "to cat\n");
    await sbx.commands.closeStdin(handle.pid);
    const result = await handle.wait();
    expect(result.stdout === "to cat\n", JSON.stringify(result.stdout));
  }

  async function commandTimeout() {
    const started = performance.now();
    try {
      await sbx.commands.run("sleep 10", { timeoutMs: 1000 });
    } catch (err) {
      const elapsed = (performance.now() - started) / 1000;
      expect(elapsed < 5, `took ${elapsed.toFixed(1)}s: ${describe(err)}`);
      expect(err.constructor.name.includes("Timeout"), describe(err));
      return;
    }
    throw new AssertionError("no timeout");
  }

  async function ptySession() {
    const chunks = [];
    const handle = await sbx.pty.create({ rows: 24, cols: 80, onData: (data) => chunks.push(Buffer.from(data)) });
    await sbx.pty.resize(handle.pid, { rows: 30, cols: 100 });
    await sbx.pty.sendInput(handle.pid, new TextEncoder().encode("stty size; echo $((6*7)); exit\n"));
    const result = await handle.wait();
    const output = Buffer.concat(chunks).toString();
    expect(output.includes("42"), JSON.stringify(output));
    expect(output.includes("30 100"), `resize not seen: ${JSON.stringify(output)}`);
    expect(result.exitCode === 0, JSON.stringify(result));
  }

  async function filesText() {
    await sbx.files.write("/home/user/t/a.txt", "alpha ✓\n");
    expect((await sbx.files.read("/home/user/t/a.txt")) === "alpha ✓\n", "text read back differs");
  }

  async function filesBinary() {
    const data = randomBytes(MIB);
    await sbx.files.write("/home/user/t/blob.bin", new Uint8Array(data).buffer);
    const back = await sbx.files.read("/home/user/t/blob.bin", { format: "bytes" });
    expect(Buffer.from(back).equals(data), `binary read back differs (${back.length} bytes)`);
  }

  async function filesOps() {
    await sbx.files.write("/home/user/dir/a.txt", "alpha");
    expect((await sbx.files.makeDir("/home/user/dir/sub")) === true, "makeDir returned false");
    expect((await sbx.files.makeDir("/home/user/dir/sub")) === false, "second makeDir returned true");
    const names = (await sbx.files.list("/home/user/dir")).map((e) => e.name).sort();
    expect(JSON.stringify(names) === '["a.txt","sub"]', JSON.stringify(names));
    const moved = await sbx.files.rename("/home/user/dir/a.txt", "/home/user/dir/b.txt");
    expect(moved.path === "/home/user/dir/b.txt", JSON.stringify(moved));
    expect(await sbx.files.exists("/home/user/dir/b.txt"), "renamed file missing");
    expect(!(await sbx.files.exists("/home/user/dir/a.txt")), "old name still exists");
    await sbx.files.remove("/home/user/dir");
    expect(!(await sbx.files.exists("/home/user/dir")), "remove left the directory");
  }

  async function filesMissing() {
    try {
      await sbx.files.read("/home/user/nope.txt");
    } catch (err) {
      expect(err.constructor.name.includes("NotFound"), describe(err));
      return;
    }
    throw new AssertionError("no error");
  }

  async function filesGzip() {
    // gzip: true makes the SDK upload application/octet-stream with Content-Encoding: gzip.
    await sbx.files.write("/home/user/z.txt", "z".repeat(10000), { gzip: true });
    const back = await sbx.files.read("/home/user/z.txt", { gzip: true });
    expect(back === "z".repeat(10000), "gzip read differs");
  }

  async function watch() {
    await sbx.files.makeDir("/home/user/aw");
    const events = [];
    const handle = await sbx.files.watchDir("/home/user/aw", (event) => events.push(event), { recursive: true });
    await sbx.files.write("/home/user/aw/f.txt", "hello");
    await sbx.files.makeDir("/home/user/aw/d");
    await sbx.files.write("/home/user/aw/d/g.txt", "nested");
    const names = () => new Set(events.filter((e) => e.type === "create").map((e) => e.name));
    await until(() => names().has("f.txt") && names().has("d/g.txt"), 5000);
    await handle.stop();
    expect(names().has("f.txt") && names().has("d/g.txt"), JSON.stringify(events));
  }

  const download = (expiration) => async () => {
    const path = `/home/user/dl-${expiration ?? "none"}.txt`;
    await sbx.files.write(path, "via url");
    const url = await sbx.downloadUrl(path, { useSignatureExpiration: expiration });
    expect(url.includes("signature_expiration=") === (expiration !== undefined), url);
    const { status, body } = await request(url, { headers: { "Accept-Encoding": "gzip" } });
    expect(status === 200, `HTTP ${status}: ${body.toString().trim()}`);
    expect(body.toString() === "via url", JSON.stringify(body.toString()));
  };

  const upload = (expiration) => async () => {
    // As a browser would: a multipart form posted to the signed URL.
    const path = `/home/user/up-${expiration ?? "none"}.txt`;
    const url = await sbx.uploadUrl(path, { useSignatureExpiration: expiration });
    expect(url.includes("signature_expiration=") === (expiration !== undefined), url);
    const form = new undici.FormData();
    form.append("file", new Blob(["uploaded!"]), "up.txt");
    const { status, body } = await request(url, { method: "POST", body: form });
    expect(status === 200, `HTTP ${status}: ${body.toString().trim()}`);
    expect((await sbx.files.read(path)) === "uploaded!", "uploadUrl content");
  };

  const noSyncApi = async () => {
    throw new NotAvailable("the JS SDK has one (async) Sandbox");
  };

  return [
    ["commands.run output", runOutput],
    ["commands.run non-zero exit", runFailure],
    ["commands.run output arrives incrementally", incremental],
    ["background command, connect(pid), kill", backgroundConnectKill],
    ["commands stdin (send_stdin)", stdin],
    ["commands close_stdin", closeStdin],
    ["commands.run timeout (AsyncSandbox)", commandTimeout],
    ["PTY create, send_stdin, resize, output", ptySession],
    ["files write/read text", filesText],
    ["files write/read 1 MiB binary", filesBinary],
    ["files list, make_dir, rename, remove, exists", filesOps],
    ["files.read missing file → NotFound", filesMissing],
    ["files gzip write/read", filesGzip],
    ["watch_dir (sync, polling)", noSyncApi],
    ["AsyncSandbox.create", noSyncApi],
    ["watch_dir (AsyncSandbox)", watch],
    ["download_url", download(undefined)],
    ["download_url with expiration", download(300)],
    ["upload_url", upload(undefined)],
    ["upload_url with expiration", upload(300)],
    ["is_running() while routed", () => sbx.isRunning()],
  ];
}

// -- checks that need relay ----------------------------------------------------------------------------

function relayChecks(sbx) {
  const port = Number(CONFIG.app_port);
  const token = sbx.trafficAccessToken;

  async function appPort() {
    expect(Boolean(token), "the API gave no traffic access token");
    expect(sbx.getHost(port) === `${port}-${sbx.sandboxId}.${process.env.E2B_DOMAIN}`, "host");
    const [url, headers] = appRequest(sbx, port, "/");
    let answer = await request(url, { headers });
    expect(answer.status === 403 && answer.body.includes("is missing"), `no token: HTTP ${answer.status}`);
    answer = await request(url, { headers: { ...headers, "E2b-Traffic-Access-Token": "wrong" } });
    expect(answer.status === 403 && answer.body.includes("is invalid"), `wrong token: HTTP ${answer.status}`);
    answer = await request(url, { headers: { ...headers, "E2b-Traffic-Access-Token": token } });
    expect(answer.status === 200, `with token: HTTP ${answer.status}`);
    const seen = JSON.parse(answer.body).headers.map(([name]) => name.toLowerCase());
    expect(!seen.includes("e2b-traffic-access-token"), `token reached the app: ${seen}`);
  }

  async function websocket() {
    const [url, headers] = appRequest(sbx, port, "/ws");
    let [sock, read, status] = await wsHandshake(url, headers);
    sock.destroy();
    expect(status === 403, `handshake without token answered ${status}`);
    [sock, read, status] = await wsHandshake(url, { ...headers, "E2b-Traffic-Access-Token": token });
    try {
      expect(status === 101, `handshake answered ${status}`);
      sock.write(wsFrame(0x1, Buffer.from("hello ws")));
      let [opcode, payload] = await wsRecv(read);
      expect(opcode === 0x1 && payload.toString() === "hello ws", "text echo");
      const binary = Buffer.concat(Array.from({ length: 300 }, () => Buffer.from([...Array(256).keys()])));
      sock.write(wsFrame(0x2, binary));
      [opcode, payload] = await wsRecv(read);
      expect(opcode === 0x2 && payload.equals(binary), "binary echo");
      sock.write(wsFrame(0x8, Buffer.concat([Buffer.from([0x03, 0xe8]), Buffer.from("bye")])));
      [opcode, payload] = await wsRecv(read);
      expect(opcode === 0x8 && payload.readUInt16BE(0) === 1000, JSON.stringify([...payload]));
    } finally {
      sock.destroy();
    }
  }

  async function wrongToken() {
    const other = await Sandbox.create(CONFIG.wrong_token_template, OPTS);
    return await other.commands.run("echo never", { timeoutMs: 10000 });
  }

  const unknownSandbox = async () => {
    await Sandbox.connect(CONFIG.unknown_sandbox_id, OPTS);
  };

  async function noRoute() {
    const ghost = await Sandbox.create(CONFIG.ghost_template, OPTS);
    return await ghost.commands.run("echo never", { timeoutMs: 10000, requestTimeoutMs: 10000 });
  }

  async function noRouteIsRunning() {
    const ghost = await Sandbox.create(CONFIG.ghost_template, OPTS);
    return await ghost.isRunning();
  }

  return [
    ["app port behind traffic token (403 without, 200 with)", appPort],
    ["WebSocket on app port", websocket],
    ["wrong envd token", wrongToken],
    ["unknown sandbox (control plane)", unknownSandbox],
    ["sandbox without a route: commands.run", noRoute],
    ["sandbox without a route: is_running()", noRouteIsRunning],
  ];
}

function afterRemovalChecks(sbx) {
  return [
    ["is_running() after route removed", () => sbx.isRunning()],
    ["commands.run after route removed", () => sbx.commands.run("echo gone", { timeoutMs: 10000, requestTimeoutMs: 10000 })],
  ];
}

// -- main -----------------------------------------------------------------------------------------------

async function runChecks(checks) {
  for (const [name, check] of checks) await runCheck(name, check);
}

async function main() {
  emit({ info: { sdk: SDK_VERSION, package: PACKAGE, form: FORM, node: process.version, proxy: PROXY, ownUndici: OWN_UNDICI } });
  const handles = {};
  await runCheck("Sandbox.create", async () => {
    handles.main = await Sandbox.create("base", OPTS);
    expect(handles.main.sandboxId === MAIN_ID, handles.main.sandboxId);
    emit({ info: { envdApiUrl: handles.main.envdApiUrl } });
  });
  await runCheck("Sandbox.connect", async () => {
    handles.connected = await Sandbox.connect(MAIN_ID, OPTS);
  });
  await runCheck("envd calls on a connect() handle", async () => {
    expect(handles.connected !== undefined, "no connect() handle");
    const result = await handles.connected.commands.run("echo connected");
    expect(result.stdout === "connected\n", JSON.stringify(result.stdout));
  });
  const sbx = handles.main;
  if (sbx === undefined) return;
  await runChecks(sandboxChecks(sbx));
  if (!CONFIG.relay) return;
  await runChecks(relayChecks(sbx));
  emit({ event: "remove-route", sandbox_id: MAIN_ID });
  const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
  const answer = await lines.next();
  expect(answer.value?.trim() === "removed", "the caller did not remove the route");
  await runChecks(afterRemovalChecks(sbx));
}

try {
  await main();
} catch (err) {
  emit({ check: "scenario", observed: describe(err), detail: String(err?.stack ?? "") });
}
// Pools and keep-alive sockets would keep the process alive.
process.exit(0);
