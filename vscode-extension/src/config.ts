// Launch/attach attributes of the `mldebug` debug type (the TypeScript side of the schema in
// package.json; test/config.test.ts checks that both list the same attributes) and their
// translation into the configuration debugpy's own adapter expects:
//   launch: debugpy runs `python -m mldebug <mldebug options> (program | -m module) args...`.
// Pure functions, no `vscode` import: configProvider.ts feeds them the editor's context.

export const DEBUG_TYPE = 'mldebug';

export type BreakKind = 'nan' | 'inf' | 'inf-all' | 'assert' | 'exception';
export const BREAK_KINDS: readonly BreakKind[] = ['nan', 'inf', 'inf-all', 'assert', 'exception'];
/** mldebug's own default for --break-on (see `python -m mldebug --help`). */
export const DEFAULT_BREAK_ON: readonly BreakKind[] = ['nan', 'inf', 'assert', 'exception'];

export type ConsoleKind = 'internalConsole' | 'integratedTerminal';

/** `"request": "launch"` attributes: package.json contributes.debuggers[0].configurationAttributes.launch. */
export interface LaunchAttributes {
  program?: string;
  module?: string;
  args?: string[];
  python?: string;
  cwd?: string;
  env?: Record<string, string>;
  breakOn?: BreakKind[];
  breakOnNaN?: boolean;
  watch?: boolean;
  justMyCode?: boolean;
  view?: boolean | number;
  console?: ConsoleKind;
}

/** `"request": "attach"` attributes: package.json ...configurationAttributes.attach. */
export interface AttachAttributes {
  connect?: { host?: string; port: number };
  host?: string;
  port?: number;
  python?: string;
  justMyCode?: boolean;
}

/** The attribute names, as a value, so a test can compare them with package.json. */
export const LAUNCH_ATTRIBUTES = ['program', 'module', 'args', 'python', 'cwd', 'env', 'breakOn',
  'breakOnNaN', 'watch', 'justMyCode', 'view', 'console'] as const satisfies readonly (keyof LaunchAttributes)[];
export const ATTACH_ATTRIBUTES = ['connect', 'host', 'port', 'python', 'justMyCode'] as const satisfies readonly (keyof AttachAttributes)[];
// Compile-time: every interface key is listed above (an unlisted key makes this `false`).
const launchListed: Exclude<keyof LaunchAttributes, typeof LAUNCH_ATTRIBUTES[number]> extends never ? true : false = true;
const attachListed: Exclude<keyof AttachAttributes, typeof ATTACH_ATTRIBUTES[number]> extends never ? true : false = true;
export const ATTRIBUTE_LISTS_COMPLETE = launchListed && attachListed;

/** What every configuration carries besides its attributes (vscode.DebugConfiguration's core). */
export interface ConfigBase {
  type?: string;
  request?: string;
  name?: string;
}
export type MlDebugConfig = ConfigBase & LaunchAttributes & AttachAttributes;

/** What debugpy's adapter receives for a launch. */
export interface DebugpyLaunch {
  type: typeof DEBUG_TYPE;
  request: 'launch';
  name: string;
  module: 'mldebug';
  args: string[];
  cwd?: string;
  env?: Record<string, string>;
  justMyCode: boolean;
  console: ConsoleKind;
  python: string[];
  redirectOutput: boolean;
  showReturnValue: boolean;
}

/** What debugpy's adapter receives for an attach. */
export interface DebugpyAttach {
  type: typeof DEBUG_TYPE;
  request: 'attach';
  name: string;
  connect: { host: string; port: number };
  justMyCode: boolean;
  python?: string[];
}

/** The editor's state that defaults depend on. */
export interface ResolveContext {
  activePythonFile?: string;       // the active editor's file, if it is Python
  workspaceFolder?: string;        // fsPath of the folder the configuration belongs to
  defaultPython?: string;          // the python.defaultInterpreterPath setting, if set
}

export type Resolved<T> = { ok: true; config: T } | { ok: false; message: string };

export const NOTHING_TO_RUN = 'mldebug: nothing to run. Set "program" (a Python file) or "module" '
  + 'in the launch configuration, or open a Python file and press F5.';

/**
 * First pass (before variables are substituted): fill defaults, or say why the launch
 * cannot start. An empty configuration (F5 without launch.json) launches the active
 * Python file.
 */
export function fillDefaults(config: MlDebugConfig, ctx: ResolveContext): Resolved<MlDebugConfig> {
  let c: MlDebugConfig = { ...config };
  if (!c.type && !c.request && !c.name) {
    if (!ctx.activePythonFile) {
      return { ok: false, message: NOTHING_TO_RUN };
    }
    c = { type: DEBUG_TYPE, request: 'launch', name: 'mldebug: current file', program: ctx.activePythonFile };
  }
  c.type = DEBUG_TYPE;
  c.request = c.request ?? 'launch';
  c.name = c.name ?? `mldebug: ${c.request}`;
  if (!c.python && ctx.defaultPython) {
    c.python = ctx.defaultPython;
  }
  if (c.request === 'attach') {
    return { ok: true, config: c };
  }
  if (c.request !== 'launch') {
    return { ok: false, message: `mldebug: "request" must be "launch" or "attach", not ${JSON.stringify(c.request)}.` };
  }
  if (!c.program && !c.module) {
    return { ok: false, message: NOTHING_TO_RUN };
  }
  if (c.program && c.module) {
    return { ok: false, message: `mldebug: give "program" or "module", not both (program=${JSON.stringify(c.program)}, module=${JSON.stringify(c.module)}).` };
  }
  c.justMyCode = c.justMyCode ?? true;
  c.cwd = c.cwd ?? ctx.workspaceFolder;
  return { ok: true, config: c };
}

/** The value of mldebug's --break-on, or undefined to leave mldebug's default. */
export function breakOnOption(c: LaunchAttributes): Resolved<string | undefined> {
  if (c.breakOn === undefined && c.breakOnNaN === undefined) {
    return { ok: true, config: undefined };
  }
  const kinds = new Set<BreakKind>(c.breakOn ?? DEFAULT_BREAK_ON);
  for (const kind of kinds) {
    if (!BREAK_KINDS.includes(kind)) {
      return { ok: false, message: `mldebug: unknown breakOn kind ${JSON.stringify(kind)} (expected some of ${BREAK_KINDS.join(', ')}).` };
    }
  }
  if (c.breakOnNaN === true) {
    kinds.add('nan');
    kinds.add('inf');
  } else if (c.breakOnNaN === false) {
    kinds.delete('nan');
    kinds.delete('inf');
    kinds.delete('inf-all');
  }
  const ordered = BREAK_KINDS.filter((k) => kinds.has(k));
  return { ok: true, config: ordered.length ? ordered.join(',') : 'none' };
}

/** mldebug's own options for a launch (everything before the program or `-m module`). */
export function mldebugOptions(c: LaunchAttributes): Resolved<string[]> {
  const breakOn = breakOnOption(c);
  if (!breakOn.ok) {
    return breakOn;
  }
  const opts: string[] = [];
  if (breakOn.config !== undefined) {
    opts.push('--break-on', breakOn.config);
  }
  if (c.watch !== undefined) {
    opts.push('--watch', c.watch ? 'on' : 'off');
  }
  if (c.view === true) {
    opts.push('--view');
  } else if (typeof c.view === 'number') {
    opts.push(`--view=${c.view}`);
  }
  return { ok: true, config: opts };
}

/** Second pass (variables substituted): the configuration debugpy's adapter gets. */
export function toDebugpy(c: MlDebugConfig, ctx: ResolveContext): Resolved<DebugpyLaunch | DebugpyAttach> {
  const python = c.python ?? ctx.defaultPython ?? 'python3';
  const name = c.name ?? DEBUG_TYPE;
  if (c.request === 'attach') {
    const port = c.connect?.port ?? c.port;
    if (port === undefined) {
      return { ok: false, message: 'mldebug: attach needs a port: "connect": {"host": "127.0.0.1", "port": 5678}.' };
    }
    const host = c.connect?.host ?? c.host ?? '127.0.0.1';
    const attach: DebugpyAttach = {
      type: DEBUG_TYPE, request: 'attach', name, connect: { host, port }, justMyCode: c.justMyCode ?? true,
    };
    if (c.python) {
      attach.python = [c.python];
    }
    return { ok: true, config: attach };
  }
  const opts = mldebugOptions(c);
  if (!opts.ok) {
    return opts;
  }
  const target = c.module ? ['-m', c.module] : c.program ? [c.program] : undefined;
  if (!target) {
    return { ok: false, message: NOTHING_TO_RUN };
  }
  const launch: DebugpyLaunch = {
    type: DEBUG_TYPE,
    request: 'launch',
    name,
    module: 'mldebug',
    args: [...opts.config, ...target, ...(c.args ?? [])],
    justMyCode: c.justMyCode ?? true,
    console: c.console ?? 'internalConsole',
    python: [python],
    redirectOutput: true,
    showReturnValue: true,
  };
  const cwd = c.cwd ?? ctx.workspaceFolder;
  if (cwd) {
    launch.cwd = cwd;
  }
  if (c.env) {
    launch.env = c.env;
  }
  return { ok: true, config: launch };
}
