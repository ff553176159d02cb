// The DebugConfigurationProvider of the `mldebug` type: asks the editor for the context
// (active Python file, workspace folder, python.defaultInterpreterPath), lets config.ts fill
// defaults and translate, and cancels politely (an error message, no session) when the
// configuration cannot run.
import * as vscode from 'vscode';
import { DEBUG_TYPE, MlDebugConfig, ResolveContext, fillDefaults, toDebugpy } from './config';

/** The python.defaultInterpreterPath setting, when set to something other than plain "python". */
export function defaultPython(folder?: vscode.WorkspaceFolder): string | undefined {
  const value = vscode.workspace.getConfiguration('python', folder?.uri).get<string>('defaultInterpreterPath');
  return value && value.trim() && value !== 'python' ? value : undefined;
}

function context(folder: vscode.WorkspaceFolder | undefined): ResolveContext {
  const doc = vscode.window.activeTextEditor?.document;
  return {
    activePythonFile: doc && doc.languageId === 'python' && doc.uri.scheme === 'file' ? doc.uri.fsPath : undefined,
    workspaceFolder: folder?.uri.fsPath ?? vscode.workspace.workspaceFolders?.[0]?.uri.fsPath,
    defaultPython: defaultPython(folder),
  };
}

/** Show why a configuration cannot start; `undefined` tells VS Code to start nothing. */
async function cancel(message: string): Promise<undefined> {
  await vscode.window.showErrorMessage(message);
  return undefined;
}

export class MlDebugConfigurationProvider implements vscode.DebugConfigurationProvider {
  async resolveDebugConfiguration(folder: vscode.WorkspaceFolder | undefined,
    config: vscode.DebugConfiguration): Promise<vscode.DebugConfiguration | undefined> {
    const filled = fillDefaults(config as MlDebugConfig, context(folder));
    if (!filled.ok) {
      return cancel(filled.message);
    }
    return { ...config, ...filled.config, type: DEBUG_TYPE, request: filled.config.request ?? 'launch', name: filled.config.name ?? DEBUG_TYPE };
  }

  async resolveDebugConfigurationWithSubstitutedVariables(folder: vscode.WorkspaceFolder | undefined,
    config: vscode.DebugConfiguration): Promise<vscode.DebugConfiguration | undefined> {
    const resolved = toDebugpy(config as MlDebugConfig, context(folder));
    if (!resolved.ok) {
      return cancel(resolved.message);
    }
    return { ...resolved.config };
  }
}
