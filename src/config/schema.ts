// The training job's config schema: one section per component, every field typed, documented and
// defaulted (torchtitan's job config). Everything else reads it: parsing and overrides (parse.ts),
// the saved config.toml, `flotilla config`. The [parallel] defaults and choices come from the layouts
// (src/parallel/layout.ts), the [model] defaults from the models' configs (src/models/*_config.ts,
// the GPT's for the fields both architectures have), the [model] architectures from the model registry.
import { PARALLEL_CHOICES, PARALLEL_DEFAULTS, type ParallelConfig } from '../parallel/layout.js';
import { defaultGPTConfig as gpt, gptRules, type GPTConfig } from '../models/gpt_config.js';
import { defaultLlamaConfig as llama, llamaAttnBiases, llamaFamilies, type LlamaConfig } from '../models/llama_config.js';
import { defaultMoEConfig, type MoEConfig } from '../nn/moe_config.js';
import type { SourceEntry } from '../data/sources.js';
import { tokenizerIdentity } from '../data/tokenizer.js';

export type { ParallelConfig } from '../parallel/layout.js';

/**
 * The [model] section: the architecture and the sizes of every built-in one (each spec reads the
 * fields it knows; src/models/registry.ts).
 */
export interface ModelConfig extends GPTConfig, LlamaConfig {
  arch: string;
  gelu: 'exact' | 'tanh';
}

export interface DataConfig {
  source: string;
  /** Weighted sources (blended); when non-empty, data.source is not used. */
  sources: SourceEntry[];
  tokenizer: string;
  valSource: string;
  seqLen: number;
  globalBatch: number;
  microBatches: number;
  valFraction: number;
  prefetch: number;
  /** What a line of data.source is: plain "text", or one JSON example a line (src/data/chat). */
  format: 'text' | 'chat' | 'completion' | 'preference';
  /** The chat template: "" (auto), "model" (the tokenizer directory's), "chatml" or a .jinja path. */
  chatTemplate: string;
  /** Which tokens of an example the loss reads: "assistant", "last" (assistant turn) or "all". */
  trainOn: 'assistant' | 'last' | 'all';
  /** Whole examples packed into rows of data.seqLen, attention kept within each example. */
  pack: boolean;
  /** An example longer than data.seqLen: "truncate" or "drop". */
  overflow: 'truncate' | 'drop';
}

export interface OptimConfig {
  /** The optimizer, by name (src/optim/registry.ts). */
  name: string;
  lr: number;
  minLr: number;
  schedule: 'cosine' | 'constant';
  warmupSteps: number;
  beta1: number;
  beta2: number;
  eps: number;
  weightDecay: number;
  gradClip: number;
}

export interface TrainConfig {
  name: string;
  runDir: string;
  steps: number;
  seed: number;
  evalEvery: number;
  evalBatches: number;
  threads: number;
  initFrom: string;
  /** "fp32" or "bf16-mixed" (float32 master weights and gradients, bf16 matmuls: src/nn/precision.ts). */
  precision: 'fp32' | 'bf16-mixed';
  /** Recompute each transformer block's forward in backward: "none", "full" or "selective". */
  activationCheckpoint: 'none' | 'full' | 'selective';
  /** Which kernels the training step uses: "eager" (op by op) or "fused" (src/nn/kernels/: attention, the loss, norms, activations, rotary). */
  kernels: 'eager' | 'fused';
  /** Passes over a finite example dataset (0 = train.steps decides). */
  epochs: number;
  /** "lm": next-token loss (on the trained tokens); "dpo": direct preference optimisation ([dpo]). */
  objective: 'lm' | 'dpo';
}

export interface CheckpointConfig {
  /** Save every this many steps (0 = never; the run still saves on Ctrl-C). */
  every: number;
  /** Checkpoints kept (the oldest are deleted once a newer one is complete). */
  keep: number;
  /** Where checkpoints go ("" = <run dir>/checkpoints). */
  dir: string;
  /** Write in the background while training continues. */
  async: boolean;
  /** 1: each host its own dir, every file also on the next host; 0: one shared dir; -1: 1 across hosts. */
  replicas: number;
}

export interface LogConfig {
  every: number;
  progress: 'auto' | 'bar' | 'plain' | 'off';
  metrics: string;
  sampleTokens: number;
  samplePrompt: string;
  /** TensorBoard event files in RUN/tb (src/train/tensorboard.ts). */
  tensorboard: boolean;
  /** One rank's peak TFLOP/s for the MFU; 0 = measured once by a short matmul probe and cached. */
  peakTflops: number;
}

/** Running as a Slurm job (src/launch/slurm.ts). */
export interface SlurmConfig {
  /** After the checkpoint a SIGUSR1 asks for, requeue the job (`scontrol requeue $SLURM_JOB_ID`). */
  requeue: boolean;
}

export type { MoEConfig } from '../nn/moe_config.js';

/** Low-rank adapters on a frozen base (src/nn/lora.ts, [Note: LoRA]); rank 0 = off. */
export interface LoraConfig {
  rank: number;
  alpha: number;
  dropout: number;
  /** Module names to adapt, as the Hugging Face model names them (q_proj, c_attn, ...), or "all-linear". */
  targets: string[];
  rsLora: boolean;
  /** The frozen base's storage: "fp32" or "bf16". */
  baseDtype: 'fp32' | 'bf16';
  /** A PEFT adapter directory to continue training ("" = new adapters). */
  adapter: string;
}

/** Direct preference optimisation (src/train/dpo.ts): train.objective = "dpo". */
export interface DpoConfig {
  beta: number;
  /** "sigmoid" (the DPO paper's -log sigmoid(beta h)) or "ipo" ((h - 1/(2 beta))^2). */
  loss: 'sigmoid' | 'ipo';
  /** Compute the reference log-probabilities of the dataset once, before training. */
  precompute: boolean;
  /** The reference model: "auto", "adapters" (the policy with LoRA adapters off) or "copy" (a frozen copy). */
  reference: 'auto' | 'adapters' | 'copy';
}

export interface FlotillaConfig {
  model: ModelConfig;
  moe: MoEConfig;
  lora: LoraConfig;
  dpo: DpoConfig;
  data: DataConfig;
  optim: OptimConfig;
  train: TrainConfig;
  parallel: ParallelConfig;
  checkpoint: CheckpointConfig;
  log: LogConfig;
  slurm: SlurmConfig;
}

type KindOf<T> = T extends boolean ? 'bool' : T extends number ? 'int' | 'float' : T extends readonly string[] ? 'strings' : T extends readonly number[] ? 'ints' : T extends readonly unknown[] ? 'sources' : 'string';

export interface Field<T> {
  doc: string;
  kind: KindOf<T>;
  default: T;
  /** Allowed values (strings). */
  choices?: readonly T[];
  /** Inclusive bounds (numbers). */
  min?: number;
  max?: number;
  /** Exclusive bounds (numbers). */
  above?: number;
  below?: number;
}

export type Schema<C> = { [S in keyof C]: { doc: string; fields: { [F in keyof C[S]]: Field<C[S][F]> } } };

/** Every section and field, with its documentation and default. */
export const configSchema: Schema<FlotillaConfig> = {
  model: {
    doc: 'The model: its architecture (src/models/registry.ts) and that architecture\'s sizes.',
    fields: {
      vocabSize: { kind: 'int', default: 0, min: 0, doc: 'Token ids the model embeds; 0 = the vocabulary of data.tokenizer (256 for bytes). Resolved when the config is read.' },
      blockSize: { kind: 'int', default: gpt.blockSize, min: 1, doc: 'Longest context in tokens (the GPT\'s learned positions; the Llama\'s max_position_embeddings).' },
      nLayer: { kind: 'int', default: gpt.nLayer, min: 1, doc: 'Transformer blocks.' },
      nHead: { kind: 'int', default: gpt.nHead, min: 1, doc: 'Attention heads per block; must divide model.nEmbd.' },
      nEmbd: { kind: 'int', default: gpt.nEmbd, min: 1, doc: 'Width of the residual stream.' },
      dropout: { kind: 'float', default: gpt.dropout, min: 0, below: 1, doc: 'Dropout probability in training (0 turns it off).' },
      bias: { kind: 'bool', default: gpt.bias, doc: '(gpt) Biases in Linear and LayerNorm layers (the Llama has none).' },
      tieEmbeddings: { kind: 'bool', default: gpt.tieEmbeddings, doc: 'Share the token embedding with the output head.' },
      arch: { kind: 'string', default: gptRules.arch, doc: 'The architecture: "gpt" (GPT-2 style: learned positions, LayerNorm, GELU MLP; src/models/gpt.ts), "llama" (RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases; src/models/llama.ts), or one a script registered with registerModel. Fields marked (gpt) or (llama) apply to that architecture only.' },
      gelu: { kind: 'string', default: gpt.gelu!, choices: ['exact', 'tanh'], doc: '(gpt) The MLP\'s GELU: "exact" (erf), or "tanh" (the approximation GPT-2 was trained with, transformers\' gelu_new).' },
      nKvHead: { kind: 'int', default: llama.nKvHead, min: 0, doc: '(llama) Key/value heads (grouped-query attention): 1 = multi-query, model.nHead = multi-head; must divide model.nHead; 0 = model.nHead.' },
      family: { kind: 'string', default: llama.family, choices: [...llamaFamilies], doc: '(llama) The Hugging Face family the model is read from and exported as: "llama" (LlamaForCausalLM), "qwen2" (Qwen2ForCausalLM, Qwen2.5: model.attnBias = "qkv"), "qwen3" (Qwen3ForCausalLM: model.qkNorm = true, model.attnBias "none" or "all"), "mistral" (MistralForCausalLM: model.slidingWindow, 0 = sliding_window null). With [moe]: "llama" or "mistral" is MixtralForCausalLM, "qwen3" Qwen3MoeForCausalLM. Set from config.json when a directory is read.' },
      attnBias: { kind: 'string', default: llama.attnBias, choices: [...llamaAttnBiases], doc: '(llama) Biases of the attention projections: "none" (Llama, Qwen3 by default), "qkv" (on q, k and v: Qwen2/2.5), "all" (q, k, v and o: attention_bias = true).' },
      qkNorm: { kind: 'bool', default: llama.qkNorm, doc: '(llama) RMSNorm of every query and key head (a weight of model.headDim each, before the rotary positions), as Qwen3.' },
      headDim: { kind: 'int', default: llama.headDim, min: 0, doc: '(llama) Width of one attention head; 0 = model.nEmbd / model.nHead.' },
      intermediateSize: { kind: 'int', default: llama.intermediateSize, min: 0, doc: '(llama) Hidden width of the SwiGLU MLP; 0 = 8/3 x model.nEmbd rounded up to a multiple of 64 (Llama\'s rule).' },
      rmsNormEps: { kind: 'float', default: llama.rmsNormEps, above: 0, doc: '(llama) RMSNorm epsilon.' },
      ropeTheta: { kind: 'float', default: llama.ropeTheta, above: 0, doc: '(llama) Rotary embedding base (Llama 2: 10000, Llama 3: 500000).' },
      ropeScaling: { kind: 'string', default: llama.ropeScaling, choices: ['none', 'llama3'], doc: '(llama) Rotary frequency scaling: "none", or "llama3" (Llama 3.1\'s long-context rule, with the four rope* fields below).' },
      ropeFactor: { kind: 'float', default: llama.ropeFactor, above: 0, doc: '(llama, ropeScaling = "llama3") Scaling factor of low frequencies (rope_scaling.factor).' },
      ropeLowFreqFactor: { kind: 'float', default: llama.ropeLowFreqFactor, above: 0, doc: '(llama, ropeScaling = "llama3") rope_scaling.low_freq_factor.' },
      ropeHighFreqFactor: { kind: 'float', default: llama.ropeHighFreqFactor, above: 0, doc: '(llama, ropeScaling = "llama3") rope_scaling.high_freq_factor; above model.ropeLowFreqFactor.' },
      ropeOriginalMaxPositions: { kind: 'int', default: llama.ropeOriginalMaxPositions, min: 1, doc: '(llama, ropeScaling = "llama3") rope_scaling.original_max_position_embeddings.' },
      slidingWindow: { kind: 'int', default: llama.slidingWindow, min: 0, doc: '(llama) Sliding-window attention (Mistral\'s sliding_window): a token reads the previous slidingWindow tokens of its document, itself included (query i reads key j when i - j < slidingWindow); 0 = full causal attention. Training (packed documents, context parallelism) and generation apply it; model.family "mistral" (and a Mixtral: "mistral" with [moe]), "qwen2" or "qwen3" (use_sliding_window) has one.' },
      windowFrom: { kind: 'int', default: llama.windowFrom, min: 0, doc: '(llama) The first block (0-based) with model.slidingWindow; the blocks below it attend with full causal attention (Qwen\'s max_window_layers; at most model.nLayer). 0 = every block windowed (Mistral, Mixtral).' },
    },
  },
  moe: {
    doc: 'Mixture of experts (src/nn/moe.ts): with moe.experts > 0, every moe.every-th block of the GPT or the Llama has an MoE MLP (a router sends each token to moe.topK of moe.experts expert MLPs); the others stay dense.',
    fields: {
      experts: { kind: 'int', default: defaultMoEConfig.experts, min: 0, doc: 'Routed experts per MoE block; 0 = no mixture of experts (every MLP dense).' },
      topK: { kind: 'int', default: defaultMoEConfig.topK, min: 1, doc: 'Experts each token goes to; at most moe.experts.' },
      every: { kind: 'int', default: defaultMoEConfig.every, min: 1, doc: 'An MoE MLP in blocks every-1, 2 every-1, ... (1 = every block, 2 = every second block).' },
      denseLayers: { kind: 'ints', default: defaultMoEConfig.denseLayers, doc: 'Blocks (0-based) that keep a dense MLP although moe.every places experts there (Qwen3-MoE\'s mlp_only_layers); e.g. [0] (on the command line: --moe.denseLayers=0,3).' },
      sharedExperts: { kind: 'int', default: defaultMoEConfig.sharedExperts, min: 0, doc: 'Experts every token goes through besides its routed ones (DeepSeek\'s shared experts).' },
      hidden: { kind: 'int', default: defaultMoEConfig.hidden, min: 0, doc: 'Hidden width of one expert; 0 = the dense MLP\'s (4 x model.nEmbd for the GPT, model.intermediateSize for the Llama).' },
      router: { kind: 'string', default: defaultMoEConfig.router, choices: ['softmax', 'sigmoid'], doc: 'Router scores: "softmax" over the experts, or each expert\'s own "sigmoid". A token\'s output is its experts\' outputs weighted by their scores. Scores are float32 under bf16-mixed; equal scores go to the lower expert index.' },
      normTopK: { kind: 'bool', default: defaultMoEConfig.normTopK, doc: 'Weight a token\'s outputs by its chosen experts\' scores renormalised to sum 1 (Mixtral; Qwen3-MoE\'s norm_topk_prob) instead of the raw scores.' },
      balance: { kind: 'string', default: defaultMoEConfig.balance, choices: ['aux', 'bias'], doc: 'Load balance: "aux" adds the Switch auxiliary loss times moe.auxCoeff; "bias" adds a per-expert bias to the scores for selection only, moved by moe.biasRate after each optimizer step toward an even load (no loss term).' },
      auxCoeff: { kind: 'float', default: defaultMoEConfig.auxCoeff, min: 0, doc: 'Weight of the auxiliary loss (moe.balance = "aux"), per MoE block.' },
      biasRate: { kind: 'float', default: defaultMoEConfig.biasRate, min: 0, doc: 'Step of the selection-bias update (moe.balance = "bias"): each expert\'s bias moves by this much after each optimizer step, up when it got fewer tokens than the mean, down when more.' },
      capacityFactor: { kind: 'float', default: defaultMoEConfig.capacityFactor, min: 0, doc: 'Assignments an expert takes per micro-batch, as a multiple of an even share (moe.topK x tokens / moe.experts); the rest are dropped (their tokens keep the residual only). 0 = no limit (dropless).' },
    },
  },
  lora: {
    doc: 'Low-rank adaptation (LoRA, as PEFT defines it: y = W x + alpha / rank x B A dropout(x), src/nn/lora.ts): with lora.rank > 0 the weights of train.initFrom (a Hugging Face directory or a flotilla checkpoint) stay frozen and only the adapters of the lora.targets modules train; checkpoints hold the adapters and their optimizer state, and `flotilla export --format peft` writes a PEFT adapter.',
    fields: {
      rank: { kind: 'int', default: 0, min: 0, doc: 'The adapters\' rank r; 0 = no adapters (every parameter trains). At most the smaller dimension of every target.' },
      alpha: { kind: 'float', default: 16, above: 0, doc: 'Scale numerator: the adapter\'s output is multiplied by alpha / rank (alpha / sqrt(rank) with lora.rsLora); PEFT\'s lora_alpha.' },
      dropout: { kind: 'float', default: 0, min: 0, below: 1, doc: 'Dropout on each adapter\'s input in training (PEFT\'s lora_dropout).' },
      targets: { kind: 'strings', default: ['all-linear'], doc: 'Modules that get adapters, named as the Hugging Face model names them (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj for a Llama; c_attn, c_proj, c_fc for a GPT-2), or flotilla module paths, or "all-linear" (every Linear but the output head); e.g. ["q_proj", "v_proj"] (on the command line: --lora.targets=q_proj,v_proj).' },
      rsLora: { kind: 'bool', default: false, doc: 'Rank-stabilised scaling alpha / sqrt(rank) instead of alpha / rank (PEFT\'s use_rslora).' },
      baseDtype: { kind: 'string', default: 'fp32', choices: ['fp32', 'bf16'], doc: 'How the frozen base is stored: "fp32" (4 bytes a parameter) or "bf16" (2; computed in the run\'s precision). The adapters are float32 either way.' },
      adapter: { kind: 'string', default: '', doc: 'A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to continue training on train.initFrom, its base; its rank, alpha and targets must equal lora\'s. "" = new adapters (A drawn from train.seed, B zero).' },
    },
  },
  dpo: {
    doc: 'Direct preference optimisation (train.objective = "dpo", src/train/dpo.ts): the policy is trained so that its log-probability ratio to a frozen reference favours the chosen response over the rejected one.',
    fields: {
      beta: { kind: 'float', default: 0.1, above: 0, doc: 'Strength of the pull toward the reference (the DPO paper\'s beta).' },
      loss: { kind: 'string', default: 'sigmoid', choices: ['sigmoid', 'ipo'], doc: '"sigmoid": -log sigmoid(beta h) (the DPO paper); "ipo": (h - 1/(2 beta))^2 on per-token mean log-probabilities. h = the chosen response\'s log-ratio to the reference minus the rejected\'s.' },
      precompute: { kind: 'bool', default: false, doc: 'Compute the reference\'s log-probabilities of the whole dataset once before training (kept in the run directory and reused on resume) instead of a reference forward each step.' },
      reference: { kind: 'string', default: 'auto', choices: ['auto', 'adapters', 'copy'], doc: 'The reference model: "adapters" (with LoRA: the same weights with the adapters off, no second copy), "copy" (a frozen copy of the starting weights, placed like the policy), "auto" = adapters with LoRA, else copy.' },
    },
  },
  data: {
    doc: 'Text, tokenization and batching (src/data). A relative path in a config file is resolved against that file\'s directory, one given on the command line against the current directory; the resolved (and saved) config holds it absolute.',
    fields: {
      source: { kind: 'string', default: 'moby-dick', doc: '"moby-dick" (the demo corpus from npm), a UTF-8 text file, a prepared directory (flotilla prepare) or a nanoGPT-style uint16 .bin; a relative path starts from the config file\'s directory.' },
      sources: {
        kind: 'sources', default: [],
        doc: 'Datasets blended by weight, e.g. [{ path = "data/web", weight = 0.7 }, { path = "data/books", weight = 0.3 }] (on the command line: --data.sources=data/web:0.7,data/books:0.3); [] = data.source alone. Relative paths start from the config file\'s directory.',
      },
      tokenizer: { kind: 'string', default: 'byte', doc: '"byte" (vocabulary 256), "gpt2" (GPT-2\'s BPE), the path of a tokenizer.json (flotilla tokenizer train) or a Hugging Face directory holding tokenizer.json (and tokenizer_config.json: its chat template, bos and eos), relative to the config file\'s directory; prepared data must have been made with the same one.' },
      valSource: { kind: 'string', default: '', doc: 'Validation data (a prepared directory, .bin or text file; a relative path starts from the config file\'s directory); "" = the last data.valFraction of every training source.' },
      seqLen: { kind: 'int', default: 128, min: 1, doc: 'Tokens per training sample; at most model.blockSize.' },
      globalBatch: {
        kind: 'int', default: 16, min: 1,
        doc: 'Samples per optimizer step over all data-parallel ranks and micro-batches; a multiple of dp x data.microBatches.',
      },
      microBatches: { kind: 'int', default: 1, min: 1, doc: 'Gradient-accumulation micro-batches per step (per rank).' },
      valFraction: { kind: 'float', default: 0.1, above: 0, below: 1, doc: 'Share of each source, taken from its end, held out for validation (when data.valSource is "").' },
      prefetch: { kind: 'int', default: 2, min: 0, doc: 'Batches a worker thread prepares ahead of the training step (0: read inline).' },
      format: { kind: 'string', default: 'text', choices: ['text', 'chat', 'completion', 'preference'], doc: 'What data.source holds: "text" (plain text or prepared tokens, every token trained); or one JSON object a line: "chat" ({"messages": [{"role", "content"}, ...]} or ShareGPT\'s {"conversations": [{"from", "value"}, ...]}), "completion" ({"prompt", "completion"}: the loss on the completion) or "preference" ({"prompt", "chosen", "rejected"}, for train.objective = "dpo").' },
      chatTemplate: { kind: 'string', default: '', doc: 'How chat examples become text: "model" (the chat_template of the tokenizer directory\'s tokenizer_config.json), "chatml" (built in) or the path of a .jinja file; "" = "model" when data.tokenizer is a Hugging Face directory.' },
      trainOn: { kind: 'string', default: 'assistant', choices: ['assistant', 'last', 'all'], doc: 'Tokens the loss is taken on (chat): "assistant" (every assistant turn, with its end-of-turn token), "last" (the last assistant turn) or "all". The loss is the mean over the trained tokens of the whole global batch.' },
      pack: { kind: 'bool', default: false, doc: 'Pack whole examples into rows of data.seqLen (attention and positions restart at each example; nothing attends across); false = one example a row, padded.' },
      overflow: { kind: 'string', default: 'truncate', choices: ['truncate', 'drop'], doc: 'An example longer than data.seqLen is cut to it ("truncate") or left out ("drop"); counted at start.' },
    },
  },
  optim: {
    doc: 'The optimizer and the learning-rate schedule (src/optim).',
    fields: {
      name: { kind: 'string', default: 'adamw', doc: 'The optimizer (src/optim/registry.ts): "adamw" (decoupled weight decay, optim.beta1, beta2, eps) or "sgd" (plain SGD, weight decay added to the gradient), or one a script registered with registerOptimizer. It updates the parameters that train (requiresGrad); a resume needs the optimizer that saved the checkpoint.' },
      lr: { kind: 'float', default: 1e-3, above: 0, doc: 'Peak learning rate (reached after the warmup).' },
      minLr: { kind: 'float', default: 1e-4, min: 0, doc: 'Learning rate at the end of the cosine decay; at most optim.lr.' },
      schedule: { kind: 'string', default: 'cosine', choices: ['cosine', 'constant'], doc: '"cosine": linear warmup then cosine decay to optim.minLr; "constant": optim.lr throughout.' },
      warmupSteps: { kind: 'int', default: 20, min: 0, doc: 'Steps of linear warmup from 0 to optim.lr (cosine schedule).' },
      beta1: { kind: 'float', default: 0.9, min: 0, below: 1, doc: '(adamw) First-moment decay.' },
      beta2: { kind: 'float', default: 0.95, min: 0, below: 1, doc: '(adamw) Second-moment decay.' },
      eps: { kind: 'float', default: 1e-8, above: 0, doc: '(adamw) Denominator epsilon.' },
      weightDecay: { kind: 'float', default: 0.1, min: 0, doc: 'Weight decay, applied to matrices only (not biases, norms): decoupled under adamw, added to the gradient (L2) under sgd.' },
      gradClip: { kind: 'float', default: 1, min: 0, doc: 'Clip the global gradient norm to this value (0 turns clipping off).' },
    },
  },
  train: {
    doc: 'The training loop (src/train/trainer.ts).',
    fields: {
      name: { kind: 'string', default: 'run', doc: 'Run name; the run directory defaults to runs/<name>.' },
      runDir: { kind: 'string', default: '', doc: 'Where the resolved config and metrics go ("" means runs/<train.name>); outputs are relative to the current directory, wherever the config file is.' },
      steps: { kind: 'int', default: 200, min: 1, doc: 'Optimizer steps to run.' },
      seed: { kind: 'int', default: 1337, min: 0, max: 0xfffffffe, doc: 'Seeds weight init, dropout and batch sampling; the same seed reproduces the run.' },
      evalEvery: { kind: 'int', default: 50, min: 0, doc: 'Validation loss every this many steps and after the last (0: only after the last).' },
      evalBatches: { kind: 'int', default: 4, min: 1, doc: 'Global batches of the validation split per evaluation (the same ones each time).' },
      threads: { kind: 'int', default: 1, min: 1, doc: 'Intra-op CPU threads per rank.' },
      precision: { kind: 'string', default: 'fp32', choices: ['fp32', 'bf16-mixed'], doc: '"bf16-mixed": matmuls in bfloat16 with float32 master parameters, optimizer state and gradient buckets; softmax, norms, GELU and the loss in float32 (the op list is in src/nn/precision.ts). float16 is not supported (it would need loss scaling).' },
      activationCheckpoint: { kind: 'string', default: 'none', choices: ['none', 'full', 'selective'], doc: 'Per transformer block: "full" keeps only the block input and recomputes its forward in backward; "selective" also keeps each Linear\'s output and recomputes LayerNorms, the attention core and GELU; "none" keeps every activation (src/nn/checkpoint.ts).' },
      kernels: { kind: 'string', default: 'fused', choices: ['eager', 'fused'], doc: 'Kernels of the training step (src/nn/kernels/). "fused" (the default): attention is one blocked kernel whose memory is linear in the sequence length (src/nn/kernels/attention.ts; the context-parallel ring\'s blocks too; attention with dropout stays eager), and the training loss is cross-entropy from the hidden state, the head\'s logits made a chunk of tokens at a time (a few MiB) and never whole, nor their gradient (src/nn/kernels/linear_cross_entropy.ts; vocab-parallel under parallel.lossParallel; LoRA on the head, a frozen bfloat16 head, a tp head without lossParallel and DPO compute logits as with "eager"); evaluation and generation still make logits (`flotilla generate` attends through the kernel a run trained with). The GPT\'s and the Llama\'s norms, GELU, SwiGLU and rotary run as one pass each (src/nn/kernels/pointwise.ts; the MoE experts\' activations too, and the rotary of generation\'s decode). The optimizer\'s update is one pass per flat bucket or shard (AdamW, SGD: src/optim/fused.ts). "eager": every op on its own.' },
      epochs: { kind: 'int', default: 0, min: 0, doc: 'Passes over an example dataset (data.format other than "text"), each shuffled by train.seed; sets the number of steps (then train.steps is left at its default). 0 = train.steps decides.' },
      objective: { kind: 'string', default: 'lm', choices: ['lm', 'dpo'], doc: '"lm": next-token cross-entropy on the trained tokens; "dpo": direct preference optimisation on data.format = "preference" ([dpo]).' },
      initFrom: { kind: 'string', default: '', doc: 'Start from the weights of a checkpoint directory or an exported .safetensors file (step 0, fresh optimizer state; fine-tuning); a relative path starts from the config file\'s directory (on the command line, the current directory); "" = random init from train.seed.' },
    },
  },
  parallel: {
    doc: 'How the model is spread over ranks (src/parallel).',
    fields: {
      dp: { kind: 'int', default: PARALLEL_DEFAULTS.dp, min: -1, doc: 'Data-parallel degree; -1 means the world size divided by parallel.pp.' },
      zero: { kind: 'int', default: PARALLEL_DEFAULTS.zero, min: 0, max: 3, doc: 'Sharding: 0 = plain data parallel; 1 = optimizer state sharded (ZeRO-1); 2 = and gradients (ZeRO-2); 3 = and parameters (ZeRO-3 / FSDP).' },
      dpShard: { kind: 'int', default: PARALLEL_DEFAULTS.dpShard, min: -1, doc: 'Ranks the model state is sharded over when zero >= 1; -1 means dp / dpReplicate.' },
      dpReplicate: { kind: 'int', default: PARALLEL_DEFAULTS.dpReplicate, min: 1, doc: 'Replicas of the sharded state when zero >= 1 (hybrid sharding, HSDP, when > 1): the data-parallel rank is replicateRank x dpShard + shardRank.' },
      accumulate: { kind: 'string', default: PARALLEL_DEFAULTS.accumulate, choices: PARALLEL_CHOICES.accumulate, doc: 'With several micro-batches: "reduceLast" reduces once per step (least communication), "reduceEach" reduces every micro-batch into the gradient shards (least memory; zero >= 2), "reduceScatterEachAllReduceLast" reduce-scatters every micro-batch and all-reduces across replicas once (HSDP); "auto" = reduceEach for zero >= 2, else reduceLast.' },
      reshardAfterForward: { kind: 'bool', default: PARALLEL_DEFAULTS.reshardAfterForward, doc: 'ZeRO-3: free each wrapping unit\'s gathered parameters after its forward and gather them again for its backward (false keeps them, trading memory for one all-gather per unit).' },
      bucketSizeMb: { kind: 'float', default: PARALLEL_DEFAULTS.bucketSizeMb, min: 0, doc: 'Gradient bucket size in MiB for the gradient collectives; 0 = the default: 25, or 4 under zero = 2 (a ZeRO-2 rank holds about three buckets of full gradients while it reduces; src/parallel/layout.ts, defaultBucketSizeMb).' },
      reduceDtype: { kind: 'string', default: PARALLEL_DEFAULTS.reduceDtype, choices: PARALLEL_CHOICES.reduceDtype, doc: 'What gradient collectives move: "fp32", or "bf16" (half the bytes; the float32 buckets are cast for the collective and back). Gradients accumulate in float32 either way.' },
      overlap: { kind: 'bool', default: PARALLEL_DEFAULTS.overlap, doc: 'Start each bucket\'s all-reduce during backward, as soon as its gradients are final.' },
      backend: { kind: 'string', default: PARALLEL_DEFAULTS.backend, choices: PARALLEL_CHOICES.backend, doc: 'Collectives: "mpi" (Open MPI, shared memory within a host; ranks start through mpirun), "gloo" (c10d Gloo over TCP), or "auto" = mpi when Open MPI is installed, else gloo.' },
      pp: { kind: 'int', default: PARALLEL_DEFAULTS.pp, min: 1, doc: 'Pipeline-parallel degree: ranks each model replica is split over (must divide the world size); data.microBatches is the pipeline\'s m.' },
      ppSchedule: { kind: 'string', default: PARALLEL_DEFAULTS.ppSchedule, choices: PARALLEL_CHOICES.ppSchedule, doc: 'Pipeline schedule: "gpipe", "1f1b", "interleaved" (ppVirtualStages stages per rank) or "zb" (zero bubble: backward split into input and weight gradients).' },
      ppVirtualStages: { kind: 'int', default: PARALLEL_DEFAULTS.ppVirtualStages, min: 1, doc: 'Stages per pipeline rank; more than 1 needs ppSchedule = "interleaved".' },
      tp: { kind: 'int', default: PARALLEL_DEFAULTS.tp, min: 1, doc: 'Tensor-parallel degree: ranks each layer\'s weights are split over (Megatron-style column/row-parallel Linear, vocab-parallel embedding); the innermost mesh dim, so these ranks are neighbours. model.nHead, nEmbd, 4 x nEmbd and vocabSize must divide by it. Tensor-parallel ranks read the same batch.' },
      sequenceParallel: { kind: 'bool', default: PARALLEL_DEFAULTS.sequenceParallel, doc: 'With tp > 1: LayerNorm, dropout and the residual stream are sharded over tokens too (all-gather / reduce-scatter instead of all-reduce); data.seqLen must divide by tp.' },
      ep: { kind: 'int', default: PARALLEL_DEFAULTS.ep, min: 1, doc: 'Expert-parallel degree: the experts of every MoE block (moe.experts, which it must divide) are split over this many neighbouring ranks of dpShard x cp (the ranks holding the same dense parameters), and tokens travel to their experts\' ranks and back by all-to-all; expert gradients are reduced over the ranks holding the same experts. Must divide the data-parallel degree x parallel.cp (and parallel.dpShard x parallel.cp when sharded); composes with parallel.zero 0-3, HSDP, parallel.cp, parallel.pp and parallel.tp (experts whole on every tp rank, without sequenceParallel).' },
      cp: { kind: 'int', default: PARALLEL_DEFAULTS.cp, min: 1, doc: 'Context-parallel degree: each sequence of a micro-batch is split over this many ranks (2 x cp chunks; rank i holds chunks i and 2cp-1-i, so every rank does the same causal-attention work) and attention runs as a ring, key/value chunks passed from rank to rank (src/parallel/context_parallel). These ranks hold the same parameters: gradients are reduced, and ZeRO shards, over dpShard x cp. data.seqLen must divide by 2 x cp; composes with parallel.zero 0-3, parallel.pp, parallel.tp (+ sequenceParallel), MoE blocks (routed over the whole sequences) and parallel.ep; not with model.dropout > 0.' },
      auto: { kind: 'bool', default: PARALLEL_DEFAULTS.auto, doc: 'Let the planner choose: `flotilla train` runs `flotilla plan` for this config and world first and trains with the layout it ranks first (the fastest predicted that fits this machine\'s memory), printing it; the [parallel] layout fields and data.microBatches, train.activationCheckpoint and train.precision here are then replaced (same as flotilla train --plan).' },
      lossParallel: { kind: 'bool', default: PARALLEL_DEFAULTS.lossParallel, doc: 'With tp > 1: the logits stay sharded over the vocabulary and the loss is the vocab-parallel cross-entropy (never gathers the full logits).' },
    },
  },
  checkpoint: {
    doc: 'Saving and resuming (src/checkpoint): every rank writes what it owns; a checkpoint loads under any layout.',
    fields: {
      every: { kind: 'int', default: 0, min: 0, doc: 'Save a checkpoint every this many steps and after the last (0: only on Ctrl-C).' },
      keep: { kind: 'int', default: 3, min: 1, doc: 'Complete checkpoints kept; older ones are deleted once a newer one is durable.' },
      dir: { kind: 'string', default: '', doc: 'Checkpoint directory ("" means <run dir>/checkpoints).' },
      async: { kind: 'bool', default: false, doc: 'Copy the state in memory and write it on a background thread while training continues (the next save and the end of the run wait for it).' },
      replicas: { kind: 'int', default: -1, min: -1, max: 1, doc: 'Across hosts without shared storage: 1 = each host saves into its own dir (a local disk) and every file it writes is also written on the next host, so losing one host leaves a complete checkpoint on the others; 0 = every host writes into one shared dir; -1 = 1 when the run spans several hosts (flotilla train --nnodes) outside a Slurm job (whose nodes share the job directory) and without [slurm] requeue = true (its checkpoint.dir is shared storage), else 0.' },
    },
  },
  log: {
    doc: 'Console progress and the metrics file (rank 0 only).',
    fields: {
      every: { kind: 'int', default: 10, min: 1, doc: 'Console update every this many steps (the metrics file gets every step).' },
      progress: { kind: 'string', default: 'auto', choices: ['auto', 'bar', 'plain', 'off'], doc: '"bar": a progress bar; "plain": log lines; "auto": bar on a terminal, lines otherwise.' },
      metrics: { kind: 'string', default: 'metrics.jsonl', doc: 'JSON-lines metrics file in the run directory, one line per step ("" turns it off).' },
      sampleTokens: { kind: 'int', default: 0, min: 0, doc: 'After the run (flotilla train), sample this many tokens from its last checkpoint into RUN/sample.txt, shown in the report (0: no sample).' },
      samplePrompt: { kind: 'string', default: '', doc: 'The text the end-of-run sample continues ("": from the end-of-text token alone).' },
      tensorboard: { kind: 'bool', default: false, doc: 'Also write TensorBoard event files into RUN/tb (loss, validation loss, learning rate, gradient norm, tokens/s, MFU, memory, MoE expert load, and the config as text); view with `tensorboard --logdir runs/`.' },
      peakTflops: { kind: 'float', default: 0, min: 0, doc: 'One rank\'s peak TFLOP/s, the MFU\'s denominator (0: measured once by a short matmul probe at the run\'s threads and precision, cached per CPU model).' },
    },
  },
  slurm: {
    doc: 'Running as a Slurm job (README "Running on a Slurm cluster"): a SIGUSR1 (sbatch --signal=USR1@90) or SIGTERM (scancel, preemption) on any rank saves a checkpoint at the end of the current step and stops the run.',
    fields: {
      requeue: { kind: 'bool', default: false, doc: 'After the checkpoint a SIGUSR1 asked for, rank 0 runs `scontrol requeue $SLURM_JOB_ID`; the requeued job (SLURM_RESTART_COUNT > 0) resumes from that checkpoint in the same run directory. A SIGTERM saves without requeueing. Needs checkpoint.dir: a directory every node of a later allocation sees.' },
    },
  },
};

export type AnyField = Omit<Field<unknown>, 'kind'> & { kind: 'int' | 'float' | 'bool' | 'string' | 'strings' | 'ints' | 'sources' };
export type RawConfig = Record<string, Record<string, unknown>>;

export const sections = Object.keys(configSchema) as (keyof FlotillaConfig)[];

export function fieldsOf(section: string): Record<string, AnyField> | undefined {
  const s = (configSchema as unknown as Record<string, { fields: Record<string, AnyField> }>)[section];
  return s?.fields;
}

/** The [model] section with the [moe] section in it: what the model specs build from. */
export function modelConfigOf(c: Pick<FlotillaConfig, 'model' | 'moe'>): ModelConfig & { moe?: MoEConfig } {
  return c.moe && c.moe.experts > 0 ? { ...c.model, moe: c.moe } : c.model;
}

export function defaultConfig(): FlotillaConfig {
  const c = schemaDefaults();
  c.model.vocabSize = tokenizerIdentity(c.data.tokenizer).vocabSize; // resolved as parseConfig does
  return c;
}

/** Every field's schema default (model.vocabSize still 0, unresolved). */
export function schemaDefaults(): FlotillaConfig {
  const out: Record<string, Record<string, unknown>> = {};
  for (const s of sections) {
    out[s] = {};
    for (const [k, f] of Object.entries(fieldsOf(s)!)) out[s]![k] = Array.isArray(f.default) ? [...f.default] : f.default;
  }
  return out as unknown as FlotillaConfig;
}

