// Chat, completion and preference examples: parsing lines, rendering chat templates, token ids and
// loss masks. A library for `flotilla prepare --format chat|completion|preference` (not wired yet).
export * from './examples.js';
export * from './template.js';
export * from './masks.js';
export * from './prompt.js';
