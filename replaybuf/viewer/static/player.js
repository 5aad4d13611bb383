// A frame-accurate player for several videos of the same length, kept in sync.
//
// The first video is the clock; the others follow it. Without videos (a buffer with no image
// field) a timer is the clock, so plots can still be played and stepped. Frame n is shown by
// seeking to the middle of its display interval, (n + 0.5) / fps, which every decoder maps to
// frame n whatever its rounding.

export class Player {
  // elements: {videos, playPause, stepBack, stepForward, timeline, counter, speed}
  constructor(elements, { fps = 30, onFrame = () => {} } = {}) {
    this.el = elements;
    this.fps = fps;
    this.onFrame = onFrame;
    this.frames = 0;
    this.frame = 0;
    this.rate = 1;
    this.playing = false;
    this.videos = [];
    this.virtualTime = 0;
    this.lastTick = null;
    this.bindControls();
    requestAnimationFrame((now) => this.tick(now));
  }

  // sources: [{name, src}], frames: number of frames in each source
  load(sources, frames, { autoplay = false } = {}) {
    this.pause();
    this.frames = frames;
    this.frame = 0;
    this.virtualTime = 0.5 / this.fps;
    this.el.videos.replaceChildren();
    this.videos = sources.map(({ name, src }) => {
      const figure = document.createElement('figure');
      const video = document.createElement('video');
      Object.assign(video, { muted: true, loop: true, playsInline: true, preload: 'auto', controls: false });
      video.dataset.field = name;
      video.playbackRate = this.rate;
      video.addEventListener('loadedmetadata', () => {
        video.style.setProperty('--aspect', `${video.videoWidth} / ${video.videoHeight}`);
        video.playbackRate = this.rate;
        if (!this.playing) video.currentTime = this.timeOf(this.frame);
      });
      const caption = document.createElement('figcaption');
      caption.textContent = name;
      video.addEventListener('error', () => {
        figure.classList.add('failed');
        caption.textContent = `${name}: the video could not be loaded (see the server's output)`;
        explainFailure(src).then((reason) => {
          if (reason && video.error) caption.textContent = `${name}: ${reason}`;
        });
      });
      video.src = src;
      figure.append(video, caption);
      this.el.videos.append(figure);
      return video;
    });
    this.el.timeline.max = String(Math.max(frames - 1, 0));
    this.render();
    if (autoplay) this.play();
  }

  get master() { return this.videos[0] ?? null; }

  timeOf(frame) { return (frame + 0.5) / this.fps; }

  frameAt(time) {
    const frame = Math.floor(time * this.fps + 1e-6);
    return this.frames ? ((frame % this.frames) + this.frames) % this.frames : 0;
  }

  seek(frame) {
    if (!this.frames) return;
    this.pause();
    this.frame = Math.max(0, Math.min(Math.round(frame), this.frames - 1));
    this.virtualTime = this.timeOf(this.frame);
    for (const video of this.videos) {
      if (video.readyState >= 1) video.currentTime = this.virtualTime;
    }
    this.render();
  }

  step(delta) { this.seek(this.frame + delta); }

  play() {
    if (!this.frames || this.playing) return;
    this.playing = true;
    this.lastTick = null;
    for (const video of this.videos) video.play().catch(() => {});
    this.render();
  }

  pause() {
    if (!this.playing) return;
    this.playing = false;
    for (const video of this.videos) video.pause();
    this.frame = this.master ? this.frameAt(this.master.currentTime) : this.frameAt(this.virtualTime);
    this.virtualTime = this.timeOf(this.frame);
    for (const video of this.videos) {
      if (video.readyState >= 1) video.currentTime = this.virtualTime;
    }
    this.render();
  }

  toggle() { this.playing ? this.pause() : this.play(); }

  setRate(rate) {
    this.rate = rate;
    for (const video of this.videos) video.playbackRate = rate;
    this.el.speed.value = String(rate);
  }

  changeRate(direction) {
    const options = [...this.el.speed.options].map((option) => Number(option.value));
    const index = options.indexOf(this.rate) + direction;
    if (index >= 0 && index < options.length) this.setRate(options[index]);
  }

  tick(now) {
    if (this.playing) {
      let time;
      if (this.master) {
        time = this.master.currentTime;
        for (const video of this.videos.slice(1)) {
          if (Math.abs(video.currentTime - time) > 1.5 / this.fps) video.currentTime = time;
        }
      } else {
        if (this.lastTick !== null) this.virtualTime += ((now - this.lastTick) / 1000) * this.rate;
        this.virtualTime %= this.frames / this.fps;
        time = this.virtualTime;
      }
      this.lastTick = now;
      const frame = this.frameAt(time);
      if (frame !== this.frame) {
        this.frame = frame;
        this.render();
      }
    }
    requestAnimationFrame((next) => this.tick(next));
  }

  render() {
    const { counter, timeline, playPause } = this.el;
    counter.textContent = `${this.frame} / ${this.frames}`;
    counter.dataset.frame = String(this.frame);
    if (document.activeElement !== timeline || this.playing) timeline.value = String(this.frame);
    const icon = this.playing ? 'pause' : 'play';
    if (playPause.dataset.icon !== icon) {
      playPause.innerHTML = ICONS[icon];
      playPause.dataset.icon = icon;
      playPause.title = `${icon} (space)`;
      playPause.setAttribute('aria-label', icon);
    }
    this.onFrame(this.frame);
  }

  bindControls() {
    const { videos, playPause, stepBack, stepForward, timeline, speed } = this.el;
    playPause.addEventListener('click', () => this.toggle());
    stepBack.addEventListener('click', (event) => this.step(event.shiftKey ? -10 : -1));
    stepForward.addEventListener('click', (event) => this.step(event.shiftKey ? 10 : 1));
    timeline.addEventListener('input', () => this.seek(Number(timeline.value)));
    speed.addEventListener('change', () => {
      this.setRate(Number(speed.value));
      speed.blur(); // give the arrow keys back to frame stepping
    });
    // clicked buttons keep no focus, so that space always means play / pause
    for (const button of [playPause, stepBack, stepForward]) {
      button.addEventListener('mousedown', (event) => event.preventDefault());
    }
    videos.addEventListener('wheel', (event) => this.onWheel(event), { passive: false });
    window.addEventListener('keydown', (event) => this.onKey(event));
  }

  onWheel(event) {
    event.preventDefault();
    const direction = Math.sign(event.deltaY || event.deltaX);
    if (direction) this.step(direction * (event.shiftKey ? 10 : 1));
  }

  onKey(event) {
    if (event.target.matches?.('input[type=text], input[type=search], textarea, select')) return;
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const jump = event.shiftKey ? 10 : 1;
    const actions = {
      ArrowLeft: () => this.step(-jump),
      ArrowRight: () => this.step(jump),
      ' ': () => this.toggle(),
      Home: () => this.seek(0),
      End: () => this.seek(this.frames - 1),
      '-': () => this.changeRate(-1),
      '+': () => this.changeRate(1),
      '=': () => this.changeRate(1),
    };
    const action = actions[event.key];
    if (action) {
      event.preventDefault();
      action();
    }
  }
}

export function playerElements(root = document) {
  const get = (id) => root.getElementById(id);
  return {
    videos: get('videos'),
    playPause: get('play-pause'),
    stepBack: get('step-back'),
    stepForward: get('step-forward'),
    timeline: get('timeline'),
    counter: get('frame-counter'),
    speed: get('speed'),
  };
}

// Why the server refused a video (a damaged episode, frames the encoder cannot take): asked
// for its first byte only, so a video that does load now is not sent whole. null if unknown.
async function explainFailure(src) {
  try {
    const response = await fetch(src, { headers: { Range: 'bytes=0-0' } });
    if (response.ok || !response.headers.get('Content-Type')?.startsWith('application/json')) return null;
    return (await response.json()).error ?? null;
  } catch {
    return null;
  }
}

export async function fetchJson(url) {
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ?? `${response.status} ${response.statusText}`);
  return body;
}

// Inline SVG, not text glyphs: a headless Debian Chromium has no font with U+23F8 (pause)
// and draws an empty box for it; these render wherever SVG does, in the button's text color.
const svg = (body) =>
  `<svg class="icon" viewBox="0 0 16 16" width="14" height="14" aria-hidden="true" focusable="false">${body}</svg>`;
const ICONS = {
  play: svg('<path d="M4 2.5v11l9.5-5.5z" fill="currentColor"/>'),
  pause: svg('<path d="M3.5 2.5h3.2v11H3.5zM9.3 2.5h3.2v11H9.3z" fill="currentColor"/>'),
  back: svg('<path d="M10.5 2.5 5 8l5.5 5.5" fill="none" stroke="currentColor" stroke-width="2"/>'),
  forward: svg('<path d="M5.5 2.5 11 8l-5.5 5.5" fill="none" stroke="currentColor" stroke-width="2"/>'),
};

export const CONTROLS_HTML = `
  <button id="step-back" title="previous frame (left arrow, shift: 10)" aria-label="previous frame">${ICONS.back}</button>
  <button id="play-pause" title="play (space)" aria-label="play" data-icon="play">${ICONS.play}</button>
  <button id="step-forward" title="next frame (right arrow, shift: 10)" aria-label="next frame">${ICONS.forward}</button>
  <input id="timeline" type="range" min="0" max="0" value="0" step="1" aria-label="timeline" />
  <span id="frame-counter" class="frame-counter" data-frame="0">0 / 0</span>
  <select id="speed" title="playback speed (- / +)">
    <option value="0.1">0.1&times;</option>
    <option value="0.25">0.25&times;</option>
    <option value="0.5">0.5&times;</option>
    <option value="1" selected>1&times;</option>
    <option value="2">2&times;</option>
    <option value="4">4&times;</option>
  </select>`;
