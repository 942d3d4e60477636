// `a2a-grpc-server serve` as a child process of the suite, started and waited for by its
// ready line (the Node twin of tests/support/serveproc.py).
//
// The interpreter comes from A2A_PYTHON (default: the repository's .venv); the server is
// the `a2a-grpc-server` console script beside it, run from the repository root so that
// `--agent tests.node.agents:Scripted` and `tests.support.agents:...` import.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
export const PYTHON = process.env.A2A_PYTHON || path.join(ROOT, '.venv', 'bin', 'python');
const SERVE = path.join(path.dirname(PYTHON), 'a2a-grpc-server');

// "a2a-grpc-server ready: grpc 127.0.0.1:PORT (plaintext), agent card http://127.0.0.1:PORT..."
const READY = /ready: grpc (\S+) \((?:plaintext|TLS|mTLS)\), agent card (https?:\/\/[^\s,]+)/;
const READY_WITHIN_MS = 20_000;
const STOP_WITHIN_MS = 10_000;

// Every server started here gets these: a task still running at shutdown is ended
// (FAILED) 0.2 s after SIGTERM, and a cancel whose executor does nothing is settled by the
// server within half a second, so no test waits on a default meant for production.
const QUICK = ['--shutdown-grace', '0.2', '--shutdown-timeout', '4', '--shutdown-flush', '1',
  '--cancel-timeout', '0.5'];

/** A running server: its gRPC address, its agent card's origin, and what it said. */
export class Server {
  constructor(proc, grpcAddr, cardUrl, said) {
    this.proc = proc;
    this.grpcAddr = grpcAddr;
    this.cardOrigin = new URL(cardUrl).origin;
    this.said = said;
    this.exited = proc.exitCode !== null || proc.signalCode !== null
      ? Promise.resolve({ code: proc.exitCode, signal: proc.signalCode })
      : once(proc, 'exit').then(([code, signal]) => ({ code, signal }));
  }

  /** SIGTERM it (a graceful shutdown) and wait, bounded, for it to exit; returns how. */
  async terminate() {
    if (this.proc.exitCode === null && this.proc.signalCode === null) this.proc.kill('SIGTERM');
    return within(this.exited, STOP_WITHIN_MS, 'server exit after SIGTERM');
  }

  /** Stop it whatever state it is in (for `after` hooks): SIGTERM, then SIGKILL if it lingers. */
  async stop() {
    try {
      await this.terminate();
    } catch {
      this.proc.kill('SIGKILL');
      await this.exited;
    }
  }

  /** The last lines it wrote to stderr (for assertion messages). */
  tail(lines = 20) {
    return this.said.join('').split('\n').slice(-lines).join('\n');
  }
}

/** Start `serve` on free loopback ports with `agent` and `args`; resolve once it is ready. */
export async function startServer(agent, ...args) {
  const proc = spawn(SERVE, ['serve', '--host', '127.0.0.1', '--port', '0', '--http-port', '0',
    '--agent', agent, ...QUICK, ...args], { cwd: ROOT, stdio: ['ignore', 'ignore', 'pipe'] });
  const said = [];
  let buffered = '';
  const ready = new Promise((resolve, reject) => {
    proc.once('error', reject); // e.g. ENOENT: no server at SERVE
    proc.once('exit', (code, signal) =>
      reject(new Error(`server exited (${code ?? signal}) before it was ready; it said:\n${said.join('')}`)));
    proc.stderr.setEncoding('utf8');
    proc.stderr.on('data', (chunk) => {
      said.push(chunk);
      if (said.length > 200) said.splice(0, said.length - 200);
      buffered += chunk;
      const match = READY.exec(buffered);
      if (match) {
        buffered = '';
        resolve(new Server(proc, match[1], match[2], said));
      } else {
        buffered = buffered.slice(-4096);
      }
    });
  });
  try {
    return await within(ready, READY_WITHIN_MS, `server ready (${SERVE})`);
  } catch (err) {
    if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGKILL'); // never leave one behind
    throw err;
  }
}

/** `promise`, or a rejection naming `what` after `ms` milliseconds. */
export function within(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}
