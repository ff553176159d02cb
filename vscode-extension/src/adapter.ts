// Starts the debug adapter: debugpy's own (`python -m debugpy.adapter`), run by the
// interpreter the configuration names (`python`), else python.defaultInterpreterPath, else
// python3. No other extension is needed.
import * as vscode from 'vscode';
import { defaultPython } from './configProvider';

/** The interpreter of a resolved configuration: `python` is a string or, for debugpy, a list. */
export function interpreterOf(configuration: vscode.DebugConfiguration, fallback?: string): string {
  const python: unknown = configuration.python;
  if (Array.isArray(python) && typeof python[0] === 'string' && python[0]) {
    return python[0];
  }
  if (typeof python === 'string' && python) {
    return python;
  }
  return fallback ?? 'python3';
}

export class DebugpyAdapterFactory implements vscode.DebugAdapterDescriptorFactory {
  createDebugAdapterDescriptor(session: vscode.DebugSession): vscode.DebugAdapterDescriptor {
    const python = interpreterOf(session.configuration, defaultPython(session.workspaceFolder));
    return new vscode.DebugAdapterExecutable(python, ['-m', 'debugpy.adapter']);
  }
}
