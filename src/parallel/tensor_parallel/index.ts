export { parallelizeModule, TensorParallelError, type TpPlan, type TpStyle, type TpStyleName, type TpPlacement, type Activation, type TensorParallelApplied } from './styles.js';
export {
  copyToRegion, reduceFromRegion, gatherLastDim, scatterLastDim, gatherSequence, reduceScatterSequence, scatterSequence,
  allReduceSum, allReduceInPlace, allGatherDim, reduceScatterDim, localSlice, tpTraffic, resetTpTraffic,
} from './comm.js';
export { vocabParallelCrossEntropy } from './loss.js';
export { TensorParallelModel, TensorParallelGrads, gatherSlices } from './model.js';
