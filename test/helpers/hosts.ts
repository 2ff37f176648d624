// Hosts for tests across machines: network namespaces, each with one interface on a subnet of its
// own (10.77.0.0/24, addresses that exist only inside the namespaces), joined by a bridge that
// lives in one more namespace, so nothing is added to the machine's own network. Needs root and
// `ip` (iproute2, installed by scripts/setup.sh). No side effects at import.
import { spawnSync } from 'node:child_process';

export interface Hosts {
  /** Namespace names, one per host; host k's interface is `${ns[k]}v`. */
  ns: string[];
  /** Host k's address. */
  addr: string[];
  /** Runs a command inside host k (the argument list for spawn('ip', ...)). */
  exec(k: number, cmd: string, args: string[]): [string, string[]];
  /** Cuts host k off the others (its interface down). */
  cut(k: number): boolean;
  drop(): void;
}

function ip(...args: string[]): { ok: boolean; err: string } {
  const r = spawnSync('ip', args, { encoding: 'utf8', timeout: 10_000 });
  return { ok: r.status === 0, err: `${r.stderr ?? ''}${r.error?.message ?? ''}`.trim() };
}

/** Makes n hosts; returns why not (a string) when namespaces cannot be made here. */
export function makeHosts(n: number, tag = String(process.pid)): Hosts | string {
  if (process.getuid?.() !== 0) return 'network namespaces need root (the suite runs as root)';
  const ns = Array.from({ length: n }, (_, k) => `flt${tag}${String.fromCharCode(97 + k)}`);
  const sw = `flt${tag}s`;
  const addr = ns.map((_, k) => `10.77.0.${k + 1}`);
  const drop = (): void => {
    for (const name of [...ns, sw]) ip('netns', 'del', name); // takes its ends of the veth pairs with it
  };
  const first = ip('netns', 'add', sw);
  if (!first.ok) return `ip netns add failed: ${first.err || 'ip (iproute2) is not installed'}`;
  const steps = [
    ['-n', sw, 'link', 'add', 'br0', 'type', 'bridge'],
    ['-n', sw, 'link', 'set', 'br0', 'up'],
    ...ns.flatMap((name, k) => [
      ['netns', 'add', name],
      ['link', 'add', `${name}v`, 'type', 'veth', 'peer', 'name', `${sw}${k}`],
      ['link', 'set', `${name}v`, 'netns', name],
      ['link', 'set', `${sw}${k}`, 'netns', sw],
      ['-n', sw, 'link', 'set', `${sw}${k}`, 'master', 'br0'],
      ['-n', sw, 'link', 'set', `${sw}${k}`, 'up'],
      ['-n', name, 'addr', 'add', `${addr[k]}/24`, 'dev', `${name}v`],
      ['-n', name, 'link', 'set', 'lo', 'up'],
      ['-n', name, 'link', 'set', `${name}v`, 'up'],
    ]),
  ];
  for (const s of steps) {
    const r = ip(...s);
    if (!r.ok) {
      drop();
      return `ip ${s.join(' ')} failed: ${r.err}`;
    }
  }
  return {
    ns, addr, drop,
    exec: (k, cmd, args) => ['ip', ['netns', 'exec', ns[k]!, cmd, ...args]],
    cut: (k) => ip('-n', ns[k]!, 'link', 'set', `${ns[k]}v`, 'down').ok,
  };
}
