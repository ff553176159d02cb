// Draws a PanelState into the page of media/panel.html: the stop banner, the list of the
// frame's tensors with inline histograms, the graph of the last pass (graph.ts, BokehJS), and
// the selected tensor (heatmap, hover, legend, dim selectors and sliders, histogram, image,
// gradient toggle). User actions are reported through the callbacks; nothing here talks to
// the extension directly.
import type { TensorEntry, TensorRequest, TensorSlice } from '../messages';
import { cellInfo, cssColour, drawHeatmap, NONFINITE_COLOURS, NONFINITE_LABELS, sliceSize, viridis } from './heatmap';
import { drawGraph, GraphActions } from './graph';
import { histogramSvg } from './histogram';
import { Banner, formatNumber, PanelState, sliceSummary } from './model';

export interface ViewActions extends GraphActions {
  request(request: TensorRequest): void;
}

function byId<T extends HTMLElement>(id: string): T {
  const el = document.getElementById(id);
  if (!el) {
    throw new Error(`panel page has no #${id}`);
  }
  return el as T;
}

function el<K extends keyof HTMLElementTagNameMap>(tag: K, cls?: string, text?: string): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) {
    e.className = cls;
  }
  if (text !== undefined) {
    e.textContent = text;
  }
  return e;
}

export function render(state: PanelState, actions: ViewActions): void {
  renderBanner(state.banner);
  const error = byId('error');
  error.hidden = !state.error;
  error.textContent = state.error ?? '';
  renderList(state.tensors, state.request?.expr ?? null, actions);
  const more = byId('tensor-more');
  more.hidden = state.truncated <= 0;
  more.textContent = `\u2026 and ${state.truncated} more`;
  renderGraph(state, actions);
  renderDetail(state, actions);
}

function renderGraph(state: PanelState, actions: ViewActions): void {
  const section = byId('graph-section');
  section.hidden = !state.graph && !state.graphNote;
  const note = byId('graph-note');
  note.textContent = state.graphNote;
  const marked = state.graph?.marked ?? [];
  byId('graph-marked').textContent = marked.length ? `marked: ${marked.join(', ')}` : '';
  drawGraph(byId('graph'), note, state.graph, actions);
}

function renderBanner(banner: Banner): void {
  const box = byId('banner');
  box.className = `banner ${banner.kind}`;
  byId('banner-title').textContent = banner.title;
  const detail = byId('banner-detail');
  detail.replaceChildren(...banner.details.map((d) => el('span', 'banner-item', d)));
  if (banner.message) {
    detail.appendChild(el('div', 'banner-message', banner.message));
  }
  if (banner.hint) {
    detail.appendChild(el('div', 'banner-hint', `Hint: ${banner.hint}`));
  }
}

function renderList(tensors: TensorEntry[], selected: string | null, actions: ViewActions): void {
  const list = byId('tensor-list');
  byId('tensor-empty').hidden = tensors.length > 0;
  list.replaceChildren(...tensors.map((t) => {
    const item = el('li', `tensor${t.name === selected ? ' selected' : ''}`);
    item.dataset.name = t.name;
    const button = el('button', 'tensor-button');
    button.title = `Show ${t.name}`;
    button.append(el('span', 'tensor-name', t.name), el('span', 'tensor-line', t.pending ? `${t.line} \u2026` : t.line));
    const s = t.summary ?? {};
    if ((s.nan ?? 0) > 0) {
      button.appendChild(el('span', 'badge nan', `NaN\u00d7${s.nan}`));
    }
    if ((s.posinf ?? 0) + (s.neginf ?? 0) > 0) {
      button.appendChild(el('span', 'badge inf', `Inf\u00d7${(s.posinf ?? 0) + (s.neginf ?? 0)}`));
    }
    if (s.hist && s.hist.length) {
      const range = s.hist_range ? `${formatNumber(s.hist_range[0])} \u2026 ${formatNumber(s.hist_range[1])}` : undefined;
      button.appendChild(histogramSvg(s.hist, 64, 16, range));
    }
    button.addEventListener('click', () => actions.request({ expr: t.name }));
    item.appendChild(button);
    return item;
  }));
}

function renderDetail(state: PanelState, actions: ViewActions): void {
  const slice = state.slice;
  const box = byId('detail');
  box.hidden = !slice;
  if (!slice) {
    return;
  }
  const request = state.request ?? { expr: slice.name };
  box.classList.toggle('stale', state.stale);
  byId('detail-name').textContent = slice.name;
  byId('detail-meta').textContent = `${slice.dtype} [${slice.shape.join(', ')}]`
    + downsampleNote(slice);
  byId('detail-summary').textContent = sliceSummary(state);
  const grad = byId<HTMLInputElement>('grad-toggle');
  grad.checked = Boolean(request.grad);
  grad.onchange = () => actions.request({ ...request, dims: dimPair(slice), index: slice.index, grad: grad.checked });
  renderDimControls(slice, request, actions);
  const canvas = byId<HTMLCanvasElement>('heatmap');
  drawHeatmap(canvas, slice, Math.min(512, Math.max(128, document.body.clientWidth - 40)));
  attachHover(canvas, slice);
  renderLegend(slice);
  const hist = byId('detail-hist');
  hist.replaceChildren();
  if (slice.hist && slice.hist.counts.length) {
    hist.appendChild(histogramSvg(slice.hist.counts, 320, 60));
    if (slice.hist.range) {
      hist.appendChild(el('div', 'hist-range', `${formatNumber(slice.hist.range[0])} \u2026 ${formatNumber(slice.hist.range[1])}`));
    }
  }
  const image = byId('image-view');
  image.hidden = !slice.image;
  if (slice.image) {
    const img = byId<HTMLImageElement>('image');
    img.src = `data:image/png;base64,${slice.image.png_base64}`;
    img.width = slice.image.width;
    img.height = slice.image.height;
  }
}

function downsampleNote(slice: TensorSlice): string {
  const s = Array.isArray(slice.stride) ? slice.stride : [slice.stride, slice.stride];
  if (s.every((v) => !v || v === 1)) {
    return '';
  }
  return `  (${slice.block_mean ? 'means of' : 'every'} ${s.join('\u00d7')} ${slice.block_mean ? 'blocks' : 'elements'})`;
}

function dimPair(slice: TensorSlice): [number, number] | null {
  const d = slice.dims;
  return d && d.length === 2 && typeof d[0] === 'number' && typeof d[1] === 'number' ? [d[0], d[1]] : null;
}

/** Two selects (row dim, column dim) and a slider for every other dim. */
function renderDimControls(slice: TensorSlice, request: TensorRequest, actions: ViewActions): void {
  const box = byId('dim-controls');
  box.replaceChildren();
  const ndim = slice.shape.length;
  if (ndim < 2) {
    return;
  }
  const dims = dimPair(slice) ?? [ndim - 2, ndim - 1];
  const index = Array.from({ length: ndim }, (_, d) => slice.index?.[d] ?? 0);
  const ask = (newDims: [number, number], newIndex: number[]): void =>
    actions.request({ ...request, dims: newDims, index: newIndex });
  const select = (label: string, which: 0 | 1): HTMLElement => {
    const s = el('select', 'dim-select');
    s.id = which === 0 ? 'dim-rows' : 'dim-cols';
    for (let d = 0; d < ndim; d++) {
      const o = el('option', undefined, `dim ${d} (${slice.shape[d]})`);
      o.value = String(d);
      o.selected = d === dims[which];
      s.appendChild(o);
    }
    s.onchange = () => {
      const next: [number, number] = [dims[0], dims[1]];
      next[which] = Number(s.value);
      if (next[0] === next[1]) {
        next[1 - which] = dims[which];       // picking the other's dim swaps them
      }
      ask(next, index);
    };
    const l = el('label', 'dim-label', `${label} `);
    l.appendChild(s);
    return l;
  };
  box.append(select('rows', 0), select('cols', 1));
  for (let d = 0; d < ndim; d++) {
    if (d === dims[0] || d === dims[1]) {
      continue;
    }
    const label = el('label', 'dim-slider');
    const value = el('span', 'dim-value', `dim ${d}: ${index[d]}`);
    const range = el('input');
    range.type = 'range';
    range.min = '0';
    range.max = String(Math.max(0, slice.shape[d] - 1));
    range.value = String(index[d]);
    range.dataset.dim = String(d);
    range.oninput = () => { value.textContent = `dim ${d}: ${range.value}`; };
    range.onchange = () => ask(dims, index.map((v, k) => (k === d ? Number(range.value) : v)));
    label.append(value, range);
    box.appendChild(label);
  }
}

function attachHover(canvas: HTMLCanvasElement, slice: TensorSlice): void {
  const hover = byId('hover');
  const { rows, cols } = sliceSize(slice);
  canvas.onmousemove = (event: MouseEvent) => {
    const rect = canvas.getBoundingClientRect();
    const col = Math.floor(((event.clientX - rect.left) / rect.width) * cols);
    const row = Math.floor(((event.clientY - rect.top) / rect.height) * rows);
    if (row < 0 || col < 0 || row >= rows || col >= cols) {
      hover.hidden = true;
      return;
    }
    const info = cellInfo(slice, row, col);
    hover.hidden = false;
    hover.textContent = `${slice.name}[${info.index.join(', ')}] = ${info.value}`;
  };
  canvas.onmouseleave = () => { hover.hidden = true; };
}

function renderLegend(slice: TensorSlice): void {
  const legend = byId('legend');
  const ramp = el('span', 'legend-ramp');
  for (let i = 0; i <= 8; i++) {
    const sw = el('span', 'swatch');
    sw.style.background = cssColour(viridis(i / 8));
    ramp.appendChild(sw);
  }
  const items: HTMLElement[] = [el('span', 'legend-value', formatNumber(slice.min)), ramp, el('span', 'legend-value', formatNumber(slice.max))];
  for (const kind of ['nan', 'inf', '-inf'] as const) {
    const item = el('span', `legend-item ${kind === 'nan' ? 'nan' : kind === 'inf' ? 'posinf' : 'neginf'}`);
    const sw = el('span', 'swatch');
    sw.style.background = cssColour(NONFINITE_COLOURS[kind]);
    item.append(sw, document.createTextNode(NONFINITE_LABELS[kind]));
    items.push(item);
  }
  legend.replaceChildren(...items);
}
