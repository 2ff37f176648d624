// Which of this host's interfaces reaches MASTER_ADDR: Gloo binds that one when ranks span hosts.
//
// Gloo's own default binds the address this host's name resolves to, and on a stock Debian host
// that is 127.0.1.1 (or 127.0.0.1): the ranks of the other hosts then cannot connect, one side fails
// at once and the other waits for the whole timeout. The interface that reaches MASTER_ADDR is the
// one the kernel's route to it names (`ip route get`), or, on the host whose address MASTER_ADDR is,
// the interface that holds that address. Without `ip`, the interface whose IPv4 subnet contains
// MASTER_ADDR. FLOTILLA_GLOO_IFACE / FLOTILLA_GLOO_HOSTNAME still override (process_group.ts).
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { isIP } from 'node:net';
import { networkInterfaces } from 'node:os';

export interface Route {
  /** The interface's name (for messages and the run header). */
  iface: string;
  /** This host's address on it: what Gloo binds. */
  address: string;
}

/** MASTER_ADDR as an IP address (resolved through the system's resolver when it is a name). */
export function resolveAddress(host: string): string | undefined {
  if (isIP(host)) return host;
  // Node resolves names only asynchronously; initProcessGroup is synchronous, so ask a child.
  const r = spawnSync(process.execPath, ['-e', `require('dns').lookup(${JSON.stringify(host)}, (e, a) => { if (e) process.exit(1); process.stdout.write(a); })`], {
    encoding: 'utf8', timeout: 10_000, stdio: ['ignore', 'pipe', 'ignore'],
  });
  return r.status === 0 && isIP(r.stdout.trim()) ? r.stdout.trim() : undefined;
}

function ipTool(): string | undefined {
  for (const p of ['/usr/sbin/ip', '/sbin/ip', '/usr/bin/ip', '/bin/ip']) if (existsSync(p)) return p;
  return undefined;
}

function ipv4ToInt(a: string): number {
  return a.split('.').reduce((n, x) => (n * 256 + Number(x)) >>> 0, 0);
}

/**
 * The interface of this host that reaches `host` (MASTER_ADDR), and this host's address on it; or
 * a sentence saying why none was found.
 */
export function routeTo(host: string): Route | string {
  const target = resolveAddress(host);
  if (target === undefined) return `MASTER_ADDR=${host} cannot be resolved`;
  const ifaces = networkInterfaces();
  // The host MASTER_ADDR names: the interface that holds the address.
  for (const [name, addrs] of Object.entries(ifaces)) {
    if ((addrs ?? []).some((a) => a.address === target)) return { iface: name, address: target };
  }
  const ip = ipTool();
  if (ip !== undefined) {
    const r = spawnSync(ip, ['-o', 'route', 'get', target], { encoding: 'utf8', timeout: 10_000, stdio: ['ignore', 'pipe', 'pipe'] });
    const dev = /\bdev (\S+)/.exec(r.stdout ?? '')?.[1];
    const src = /\bsrc (\S+)/.exec(r.stdout ?? '')?.[1];
    if (r.status === 0 && dev !== undefined && src !== undefined) return { iface: dev, address: src };
    if (r.status !== 0) return `no route to MASTER_ADDR=${host} (${target}): ${(r.stderr ?? '').trim() || `ip exited with ${r.status}`}`;
  }
  if (isIP(target) === 4) {
    const t = ipv4ToInt(target);
    for (const [name, addrs] of Object.entries(ifaces)) {
      for (const a of addrs ?? []) {
        if (a.family !== 'IPv4' || a.internal) continue;
        const mask = ipv4ToInt(a.netmask);
        if ((ipv4ToInt(a.address) & mask) === (t & mask)) return { iface: name, address: a.address };
      }
    }
  }
  return `no interface of this host reaches MASTER_ADDR=${host} (${target})${ip === undefined ? '; install iproute2 so that the route to it can be asked' : ''}`;
}
