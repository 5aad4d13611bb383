// Line plots of one episode's per-timestep fields, drawn on canvas, with a frame cursor.
//
// A plot has two stacked canvases: the lines (redrawn on resize) and the cursor (redrawn on
// every frame change), so following playback costs one thin line per frame.

const COLORS = ['#7fb4e6', '#f2a65a', '#8fd18f', '#e88a8a', '#c3a3e8', '#c9a27e', '#ef9fd0', '#b0b0b0', '#d9d26a', '#6fd3d6'];
const PAD = { left: 44, right: 8, top: 8, bottom: 16 };

function columnsOf(values) {
  // values: [T] of numbers / bools / null, or [T][D]
  if (values.length && Array.isArray(values[0])) {
    return values[0].map((_, dim) => values.map((row) => row[dim]));
  }
  return [values];
}

function asNumber(value) {
  if (value === null || value === undefined) return null;
  return typeof value === 'boolean' ? Number(value) : value;
}

function formatValue(value) {
  if (value === null || value === undefined) return 'nan';
  if (typeof value === 'boolean') return String(value);
  if (Number.isInteger(value)) return String(value);
  return Math.abs(value) >= 1e4 || (Math.abs(value) < 1e-3 && value !== 0) ? value.toExponential(2) : value.toFixed(3);
}

export class SeriesPlot {
  // values: the series of every `stride`-th step of an episode of `steps` steps (a long
  // episode's is thinned by the server); the cursor and seeks count the episode's steps
  constructor(parent, name, values, { onSeek = () => {}, stride = 1, steps = values.length } = {}) {
    this.name = name;
    this.stride = stride;
    this.steps = steps;
    this.columns = columnsOf(values).map((column) => column.map(asNumber));
    this.raw = columnsOf(values);
    // booleans (done, success) hold their value until the next step: draw them as steps
    this.stepped = this.raw.map((column) => column.some((value) => typeof value === 'boolean'));
    this.length = values.length;
    this.cursor = 0;
    this.onSeek = onSeek;

    this.root = document.createElement('div');
    this.root.className = 'plot';
    this.root.dataset.field = name;
    const title = document.createElement('h2');
    const notes = [this.columns.length > 1 ? `${this.columns.length} dims` : '', stride > 1 ? `one point per ${stride} steps` : '']
      .filter(Boolean);
    title.textContent = notes.length ? `${name} (${notes.join(', ')})` : name;
    title.style.margin = '0 0 4px';
    this.area = document.createElement('div');
    this.area.className = 'plot-canvas';
    this.lines = document.createElement('canvas');
    this.lines.className = 'lines';
    this.overlay = document.createElement('canvas');
    this.overlay.className = 'cursor';
    this.area.append(this.lines, this.overlay);
    this.legend = document.createElement('div');
    this.legend.className = 'legend';
    this.labels = this.columns.map((_, dim) => {
      const label = document.createElement('span');
      label.style.setProperty('--swatch', COLORS[dim % COLORS.length]);
      this.legend.append(label);
      return label;
    });
    this.root.append(title, this.area, this.legend);
    parent.append(this.root);

    this.min = Infinity;
    this.max = -Infinity;
    for (const column of this.columns) {
      for (const value of column) {
        if (value === null || !Number.isFinite(value)) continue;
        if (value < this.min) this.min = value;
        if (value > this.max) this.max = value;
      }
    }
    if (this.min > this.max) { this.min = 0; this.max = 1; }
    if (this.max === this.min) { this.max += 0.5; this.min -= 0.5; }

    this.seeking = false;
    this.area.addEventListener('pointerdown', (event) => {
      this.seeking = true;
      this.area.setPointerCapture(event.pointerId);
      this.seekAt(event);
    });
    this.area.addEventListener('pointermove', (event) => { if (this.seeking) this.seekAt(event); });
    this.area.addEventListener('pointerup', () => { this.seeking = false; });
    this.resizeObserver = new ResizeObserver(() => this.draw());
    this.resizeObserver.observe(this.area);
  }

  x(frame, width) {
    return PAD.left + (this.steps > 1 ? (frame / (this.steps - 1)) * (width - PAD.left - PAD.right) : 0);
  }

  // the position in `values` of the step shown for episode step `frame`
  pointAt(frame) {
    return Math.max(0, Math.min(Math.floor(frame / this.stride), this.length - 1));
  }

  y(value, height) {
    return PAD.top + (1 - (value - this.min) / (this.max - this.min)) * (height - PAD.top - PAD.bottom);
  }

  seekAt(event) {
    const box = this.area.getBoundingClientRect();
    const fraction = (event.clientX - box.left - PAD.left) / Math.max(box.width - PAD.left - PAD.right, 1);
    this.onSeek(Math.round(Math.max(0, Math.min(1, fraction)) * (this.steps - 1)));
  }

  sizeCanvas(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const { width, height } = this.area.getBoundingClientRect();
    canvas.width = Math.max(1, Math.round(width * ratio));
    canvas.height = Math.max(1, Math.round(height * ratio));
    const context = canvas.getContext('2d');
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    return { context, width, height };
  }

  draw() {
    const { context, width, height } = this.sizeCanvas(this.lines);
    context.clearRect(0, 0, width, height);
    context.font = '10px ui-monospace, monospace';
    context.fillStyle = '#8a8f98';
    context.strokeStyle = '#26282c';
    context.lineWidth = 1;
    context.textAlign = 'right';
    for (const value of [this.max, this.min, ...(this.min < 0 && this.max > 0 ? [0] : [])]) {
      const y = this.y(value, height);
      context.beginPath();
      context.moveTo(PAD.left, y);
      context.lineTo(width - PAD.right, y);
      context.stroke();
      context.fillText(formatValue(value), PAD.left - 4, y + 3);
    }
    context.textAlign = 'left';
    context.fillText('0', PAD.left, height - 3);
    context.textAlign = 'right';
    context.fillText(String(this.steps - 1), width - PAD.right, height - 3);

    this.columns.forEach((column, dim) => {
      context.strokeStyle = COLORS[dim % COLORS.length];
      context.lineWidth = 1.25;
      context.beginPath();
      let drawing = false;
      let previousY = 0;
      column.forEach((value, point) => {
        if (value === null || !Number.isFinite(value)) { drawing = false; return; }
        const x = this.x(point * this.stride, width);
        const y = this.y(value, height);
        if (drawing && this.stepped[dim]) context.lineTo(x, previousY);
        if (drawing) context.lineTo(x, y); else context.moveTo(x, y);
        previousY = y;
        drawing = true;
      });
      if (this.length === 1 && column[0] !== null) context.arc(this.x(0, width), this.y(column[0], height), 2, 0, 2 * Math.PI);
      context.stroke();
    });
    this.drawCursor();
  }

  setCursor(frame) {
    this.cursor = Math.max(0, Math.min(frame, this.steps - 1));
    this.drawCursor();
    const point = this.pointAt(this.cursor);
    const step = this.stride > 1 ? ` @${point * this.stride}` : '';
    this.labels.forEach((label, dim) => {
      const name = this.columns.length > 1 ? `${this.name}[${dim}]` : this.name;
      label.textContent = `${name}${step} = ${formatValue(this.raw[dim][point])}`;
    });
  }

  drawCursor() {
    const { context, width, height } = this.sizeCanvas(this.overlay);
    context.clearRect(0, 0, width, height);
    const x = this.x(this.cursor, width);
    context.strokeStyle = '#ffffff';
    context.globalAlpha = 0.7;
    context.beginPath();
    context.moveTo(x, PAD.top);
    context.lineTo(x, height - PAD.bottom);
    context.stroke();
    context.globalAlpha = 1;
    this.columns.forEach((column, dim) => {
      const value = column[this.pointAt(this.cursor)];
      if (value === null || !Number.isFinite(value)) return;
      context.fillStyle = COLORS[dim % COLORS.length];
      context.beginPath();
      context.arc(x, this.y(value, height), 2.5, 0, 2 * Math.PI);
      context.fill();
    });
  }

  remove() {
    this.resizeObserver.disconnect();
    this.root.remove();
  }
}
