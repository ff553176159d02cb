// The commands: "Inspect in mldebug" on a variable of the Variables view, "Open Browser
// View" (mldebug's Bokeh view of the paused program) and "Show Tensors Panel".
import * as vscode from 'vscode';
import { DEBUG_TYPE } from './config';
import type { Inspector, InspectorSession } from './inspector';
import { browserViewUrl } from './panelApi';

/** The argument VS Code passes to a `debug/variables/context` command. */
export interface VariableContext {
  sessionId?: string;
  variable?: { name: string; value?: string; evaluateName?: string; variablesReference?: number };
}

/** The frame the user has selected in an mldebug session, else the frame of the last stop. */
export function selectedFrame(inspector: Inspector): { session: InspectorSession; frameId: number } | undefined {
  const item = vscode.debug.activeStackItem;
  if (item instanceof vscode.DebugStackFrame && item.session.type === DEBUG_TYPE) {
    return { session: item.session, frameId: item.frameId };
  }
  return inspector.pausedFrame;
}

export async function inspectVariable(inspector: Inspector, context: VariableContext | undefined): Promise<void> {
  const variable = context?.variable;
  if (!variable) {
    await vscode.window.showInformationMessage('mldebug: right-click a variable in the Variables view to inspect it.');
    return;
  }
  await inspector.requestTensor({ expr: variable.evaluateName ?? variable.name }, selectedFrame(inspector));
}

export async function openBrowserView(inspector: Inspector): Promise<void> {
  const frame = selectedFrame(inspector);
  const url = frame && await browserViewUrl(frame.session, frame.frameId);
  if (!url) {
    await vscode.window.showInformationMessage(frame
      ? 'mldebug: the browser view is not available in this program (mldebug.view() is missing or returned no URL).'
      : 'mldebug: the browser view is available while an mldebug session is paused.');
    return;
  }
  const external = await vscode.env.asExternalUri(vscode.Uri.parse(url));
  await vscode.env.openExternal(external);
}
