// Draws the graph of the last forward pass: the browser view's own graph figure, which Python
// sends as a standalone Bokeh document (dap/panel.py graph_json, bokeh.embed.json_item), embedded
// by the program's BokehJS (loaded by the page's script tags, see panel.ts), no drawing here.
// Clicks: the figure's TapTool selects a row of its node source ('mld-graph-nodes') or of its
// toggle source ('mld-graph-toggles'); the selection's change signal, read from BokehJS's own
// models (no CustomJS, so the CSP needs no 'unsafe-eval'), becomes a request to the extension:
// a node's output, or the graph again with a module opened or closed (Python draws it).
import type { GraphPayload } from '../messages';

/** The parts of BokehJS (window.Bokeh) used here. */
interface BokehSource {
  get_column(name: string): ArrayLike<unknown> | null;
  selected: { indices: number[]; properties: { indices: { change: { connect(slot: () => void): boolean } } } };
}
interface BokehDocument {
  get_model_by_name(name: string): unknown;
}
interface BokehView { model: { document: BokehDocument | null }; remove(): void }
interface BokehApi {
  version: string;
  documents?: BokehDocument[];
  embed: { embed_item(item: unknown, target: HTMLElement): Promise<{ roots: BokehView[] }> };
}

export interface GraphActions {
  node(id: string, label: string): void;
  toggle(id: string): void;
}

let shown: { payload: GraphPayload; views: BokehView[] } | undefined;
let drawing: GraphPayload | undefined;

function bokeh(): BokehApi | undefined {
  return (window as unknown as { Bokeh?: BokehApi }).Bokeh;
}

/** Why the graph cannot be drawn, or undefined when it can. */
export function cannotDraw(payload: GraphPayload, api = bokeh()): string | undefined {
  if (!api) {
    return `BokehJS did not load from ${payload.bokeh.js.join(', ')} (the program's bokeh ${payload.bokeh.version} `
      + 'must be readable where VS Code runs).';
  }
  if (api.version !== payload.bokeh.version) {
    return `BokehJS ${api.version} is loaded, the graph was written by bokeh ${payload.bokeh.version}.`;
  }
  return undefined;
}

/** Show PAYLOAD in BOX (again only when it changed); NOTE gets the errors. */
export function drawGraph(box: HTMLElement, note: HTMLElement, payload: GraphPayload | null, actions: GraphActions): void {
  if (payload === shown?.payload || payload === drawing) {
    return;
  }
  clear(box);
  if (!payload) {
    return;
  }
  const why = cannotDraw(payload);
  if (why) {
    note.textContent = why;
    return;
  }
  drawing = payload;
  void bokeh()!.embed.embed_item(payload.item, box).then((views) => {
    if (drawing !== payload) {              // a newer graph came while this one was embedded
      views.roots.forEach((v) => v.remove());
      return;
    }
    drawing = undefined;
    shown = { payload, views: views.roots };
    const doc = views.roots[0]?.model.document;
    const nodes = doc?.get_model_by_name('mld-graph-nodes') as BokehSource | null | undefined;
    const toggles = doc?.get_model_by_name('mld-graph-toggles') as BokehSource | null | undefined;
    box.dataset.drawn = String(payload.modules);
    if (nodes) {
      onPick(nodes, (i) => actions.node(String(nodes.get_column('id')?.[i]), String(nodes.get_column('label')?.[i] ?? '')));
    }
    if (toggles) {
      onPick(toggles, (i) => actions.toggle(String(toggles.get_column('id')?.[i])));
    }
  }, (e: unknown) => {
    drawing = undefined;
    note.textContent = `The graph could not be drawn: ${e instanceof Error ? e.message : String(e)}`;
  });
}

/** Call PICK with the row a tap selected, then clear the selection (a second tap on the same
 *  row picks it again). */
function onPick(source: BokehSource, pick: (index: number) => void): void {
  source.selected.properties.indices.change.connect(() => {
    const index = source.selected.indices[0];
    if (index === undefined) {
      return;
    }
    source.selected.indices = [];
    pick(index);
  });
}

function clear(box: HTMLElement): void {
  shown?.views.forEach((v) => v.remove());
  const docs = bokeh()?.documents;
  const old = shown?.views[0]?.model.document;
  if (docs && old) {
    const at = docs.indexOf(old);
    if (at >= 0) {
      docs.splice(at, 1);
    }
  }
  shown = undefined;
  drawing = undefined;
  box.replaceChildren();
  delete box.dataset.drawn;
}
